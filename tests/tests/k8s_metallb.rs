//! Switching from MetalLB: Services that MetalLB gave addresses keep them when
//! vip's controller takes over (also after a restart), and MetalLB's annotations
//! are honoured with a Warning suggesting vip's own. Run against the stand-in and
//! a real kube-apiserver (`both_api_servers!`).
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use vip_agent::k8s::{
    controller::{AgentView, Controller, Pass},
    crd::VipPool,
};
use vip_tests::{
    kubeapi::Backend,
    kubefix::{events, eventually, ingress_ips, vip_pool},
};

vip_tests::both_api_servers!(addresses_metallb_gave_are_kept_and_its_annotations_honoured);

fn lb(name: &str, port: i32, annotations: Value) -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": "shop", "annotations": annotations },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": port, "protocol": "TCP" }] }
    }))
    .unwrap()
}

/// Passes of `c` until `done` holds for the server's Service addresses (at most
/// 100, 50 ms apart); the sum of what they did.
async fn passes_until(c: &mut Controller, api: &Backend, what: &str, done: impl Fn(&BTreeMap<String, String>) -> bool) -> Pass {
    let mut sum = Pass::default();
    for _ in 0..100 {
        let p = c.pass().await;
        sum.allocated += p.allocated;
        sum.released += p.released;
        sum.pending += p.pending;
        sum.metallb_warnings += p.metallb_warnings;
        if done(&ingress_ips(api)) {
            return sum;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("not reached: {what}; addresses {:?}", ingress_ips(api));
}

async fn addresses_metallb_gave_are_kept_and_its_annotations_honoured(api: Backend) {
    let client = api.client().await;
    let pools: Api<VipPool> = Api::all(client.clone());
    let pp = PostParams::default();
    pools.create(&pp, &vip_pool("default", json!({"addresses": ["198.18.5.10-198.18.5.13"]}))).await.unwrap();
    pools.create(&pp, &vip_pool("manual", json!({"addresses": ["198.18.5.20/31"], "autoAssign": false}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    // What MetalLB left: addresses in the Services' statuses (not the lowest free
    // ones), one asked for by annotation, one from a pool without autoAssign named
    // by the older annotation form, two sharing one address.
    let held = [
        ("high", 80, json!({}), "198.18.5.13"),
        ("asked", 80, json!({"metallb.io/loadBalancerIPs": "198.18.5.12"}), "198.18.5.12"),
        ("pinned", 80, json!({"metallb.universe.tf/address-pool": "manual"}), "198.18.5.21"),
        ("web", 80, json!({"metallb.io/allow-shared-ip": "front"}), "198.18.5.10"),
        ("tls", 443, json!({"metallb.io/allow-shared-ip": "front"}), "198.18.5.10"),
    ];
    for (name, port, ann, ip) in &held {
        svcs.create(&pp, &lb(name, *port, ann.clone())).await.unwrap();
        let status = json!({"status": {"loadBalancer": {"ingress": [{"ip": ip}]}}});
        svcs.patch_status(name, &PatchParams::default(), &Patch::Merge(&status)).await.unwrap();
    }
    svcs.create(&pp, &lb("new", 80, json!({}))).await.unwrap();
    svcs.create(&pp, &lb("v6-only", 80, json!({"metallb.io/loadBalancerIPs": "2001:db8::7"}))).await.unwrap();
    // vip's own annotation wins over MetalLB's.
    svcs.create(&pp, &lb("both", 8080, json!({"metallb.io/loadBalancerIPs": "198.18.5.11", "vip.dev/address": "198.18.5.20"}))).await.unwrap();
    let mut want: BTreeMap<String, String> = held.iter().map(|(n, _, _, ip)| (format!("shop/{n}"), ip.to_string())).collect();
    want.insert("shop/new".into(), "198.18.5.11".into());
    want.insert("shop/both".into(), "198.18.5.20".into());

    let (mut c, _changed) = Controller::new(client.clone(), "node-1", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    let p = passes_until(&mut c, &api, "new and both allocated", |now| now.len() == want.len()).await;
    assert_eq!(ingress_ips(&api), want, "no Service that held an address moved");
    assert_eq!((p.allocated, p.released), (2, 0), "{p:?}");
    assert_eq!(p.metallb_warnings, 6, "asked, pinned, web, tls, v6-only, both: {p:?}");
    let warned = |svc: &str| events(&api, "MetalLBAnnotation").into_iter().filter(|e| e.starts_with(&format!("{svc}: "))).collect::<Vec<_>>();
    eventually("6 MetalLBAnnotation events", || events(&api, "MetalLBAnnotation").len() >= 6).await;
    assert_eq!(warned("asked"), ["asked: MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead"]);
    assert_eq!(warned("pinned"), ["pinned: MetalLB annotations: metallb.universe.tf/address-pool is honoured: use vip.dev/pool instead"]);
    assert_eq!(warned("both"), ["both: MetalLB annotations: metallb.io/loadBalancerIPs is ignored: vip.dev/address is set too and wins"]);
    assert!(warned("high").is_empty());
    let failed = events(&api, "AllocationFailed");
    assert!(
        failed.iter().any(|e| e.starts_with("v6-only: metallb.io/loadBalancerIPs asks only for an IPv6 address (2001:db8::7): vip serves IPv4 addresses only")),
        "{failed:?}"
    );
    assert_eq!(events(&api, "Allocated").len(), 2, "only new and both were written: {:?}", events(&api, "Allocated"));
    assert!(events(&api, "Released").is_empty(), "{:?}", events(&api, "Released"));

    // Further passes say nothing again.
    for _ in 0..3 {
        let p = c.pass().await;
        assert_eq!((p.allocated, p.released, p.metallb_warnings), (0, 0, 0), "{p:?}");
    }
    // A spec change is no reason to say it again; a changed annotation is.
    svcs.patch("asked", &PatchParams::default(), &Patch::Merge(json!({"spec": {"ports": [{"port": 81, "protocol": "TCP"}]}}))).await.unwrap();
    let dual = json!({"metadata": {"annotations": {"metallb.io/loadBalancerIPs": "198.18.5.12,2001:db8::12"}}});
    svcs.patch("asked", &PatchParams::default(), &Patch::Merge(dual)).await.unwrap();
    let mut again = 0;
    for _ in 0..100 {
        again += c.pass().await.metallb_warnings;
        if again > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(again, 1, "one Warning for the changed annotation of asked");
    eventually("the second Warning on asked", || warned("asked").len() == 2).await;
    assert!(warned("asked").iter().any(|e| e.contains("its IPv6 address 2001:db8::12 is ignored: vip serves IPv4 only")), "{:?}", warned("asked"));
    assert_eq!(c.pass().await.metallb_warnings, 0);

    // A restarted agent (or a new leader) starts from the API alone: nothing moves.
    drop(c);
    let (mut c, _changed) = Controller::new(client.clone(), "node-2", AgentView::fixed(BTreeMap::new()).1);
    c.wait_ready().await;
    for _ in 0..3 {
        let p = c.pass().await;
        assert_eq!((p.allocated, p.released), (0, 0), "{p:?}");
    }
    assert_eq!(ingress_ips(&api), want, "nothing moved after the restart");
    assert!(events(&api, "Released").is_empty(), "{:?}", events(&api, "Released"));
}
