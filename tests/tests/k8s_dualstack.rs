//! Dual-stack Services on a dual-stack cluster (service CIDRs `10.96.0.0/16` and
//! `fd00:10:96::/112`, IPv4 primary): the families the API server gives a Service
//! (`spec.ipFamilies`, `spec.ipFamilyPolicy`) are the families of the addresses the
//! running controller writes to `status.loadBalancer.ingress`, in the Service's
//! family order; RequireDualStack from a pool without the second family gets an
//! `AllocationFailed` Event and no address (never half an answer); a SingleStack
//! Service upgraded to PreferDualStack (which the server allows) gets its second
//! address, and downgraded again gives it back.
//!
//! Every scenario runs against the in-process stand-in in its dual-stack mode
//! (`NAME::stand_in`) and a real kube-apiserver started dual-stack (`NAME::real`,
//! skipped without `KUBEBUILDER_ASSETS` unless CI=true), as in k8s_addresses.rs.
use std::{net::IpAddr, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use vip_agent::k8s::crd::VipPool;
use vip_tests::{
    kubeapi::Backend,
    kubefix::{events, eventually, run_controller, vip_pool},
};

vip_tests::both_api_servers!(each_family_policy_gets_its_addresses_in_family_order, Stack::Dual);
vip_tests::both_api_servers!(require_dual_stack_from_one_family_gets_nothing_until_both, Stack::Dual);
vip_tests::both_api_servers!(a_service_upgraded_to_dual_stack_gets_its_second_address, Stack::Dual);

/// Test addresses only: 198.18.0.0/15 and 2001:2::/48.
const DUAL: [&str; 2] = ["198.18.1.10-198.18.1.19", "2001:2::10-2001:2::19"];

fn lb(name: &str, extra_spec: Value) -> Service {
    let mut spec = json!({ "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] });
    spec.as_object_mut().unwrap().extend(extra_spec.as_object().unwrap().clone());
    serde_json::from_value(json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "shop" }, "spec": spec })).unwrap()
}

/// A Service's `status.loadBalancer.ingress` addresses, in order.
fn ingress(api: &Backend, name: &str) -> Vec<IpAddr> {
    let s = api.get("services", Some("shop"), name).unwrap_or_default();
    s["status"]["loadBalancer"]["ingress"].as_array().into_iter().flatten().filter_map(|i| i["ip"].as_str()?.parse().ok()).collect()
}

/// The families of `addrs`, as `spec.ipFamilies` names them.
fn families_of(addrs: &[IpAddr]) -> Vec<&'static str> {
    addrs.iter().map(|a| if a.is_ipv4() { "IPv4" } else { "IPv6" }).collect()
}

/// What the server made of a Service's families: (`ipFamilies`, `ipFamilyPolicy`, number of clusterIPs).
fn server_families(api: &Backend, name: &str) -> (Value, Value, usize) {
    let spec = api.get("services", Some("shop"), name).unwrap()["spec"].clone();
    (spec["ipFamilies"].clone(), spec["ipFamilyPolicy"].clone(), spec["clusterIPs"].as_array().map_or(0, Vec::len))
}

/// RequireDualStack in either order, PreferDualStack (the server adds the second
/// family), SingleStack IPv6 and the default (SingleStack IPv4) from one pool of
/// both families: as many addresses as `ipFamilies` names, in its order, all
/// distinct and from the pool.
async fn each_family_policy_gets_its_addresses_in_family_order(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("dual", json!({ "addresses": DUAL }))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    let cases: [(&str, Value, Value, &str); 5] = [
        ("require-46", json!({ "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv4", "IPv6"] }), json!(["IPv4", "IPv6"]), "RequireDualStack"),
        ("require-64", json!({ "ipFamilyPolicy": "RequireDualStack", "ipFamilies": ["IPv6", "IPv4"] }), json!(["IPv6", "IPv4"]), "RequireDualStack"),
        ("prefer", json!({ "ipFamilyPolicy": "PreferDualStack" }), json!(["IPv4", "IPv6"]), "PreferDualStack"),
        ("v6", json!({ "ipFamilies": ["IPv6"] }), json!(["IPv6"]), "SingleStack"),
        ("default", json!({}), json!(["IPv4"]), "SingleStack"),
    ];
    for (name, spec, _, _) in &cases {
        svcs.create(&pp, &lb(name, spec.clone())).await.unwrap();
    }
    for (name, _, fams, policy) in &cases {
        let (got_fams, got_policy, cluster_ips) = server_families(&api, name);
        assert_eq!((&got_fams, got_policy.as_str().unwrap(), cluster_ips), (fams, *policy, fams.as_array().unwrap().len()), "{name}");
    }
    let (_lead, task) = run_controller(client.clone());
    eventually("every Service addressed", || cases.iter().all(|(name, ..)| !ingress(&api, name).is_empty())).await;
    // One more pass: nothing else is added.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let mut all = Vec::new();
    for (name, _, fams, _) in &cases {
        let got = ingress(&api, name);
        assert_eq!(json!(families_of(&got)), *fams, "{name}: {got:?}");
        all.extend(got);
    }
    let n = all.len();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), n, "distinct addresses: {all:?}");
    assert!(events(&api, "AllocationFailed").is_empty(), "{:?}", events(&api, "AllocationFailed"));
    task.abort();
}

/// A RequireDualStack Service sent to an IPv4-only pool (`vip.dev/pool`) gets an
/// `AllocationFailed` Warning naming the missing family and no address, while a
/// PreferDualStack one from the same pool gets its IPv4 address; once the pool
/// has IPv6 addresses the second gets one and the first both.
async fn require_dual_stack_from_one_family_gets_nothing_until_both(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    let pools: Api<VipPool> = Api::all(client.clone());
    pools.create(&pp, &vip_pool("dual", json!({ "addresses": DUAL }))).await.unwrap();
    pools.create(&pp, &vip_pool("v4", json!({ "addresses": ["198.18.2.10-198.18.2.11"], "autoAssign": false }))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    let to_v4 = |name: &str, policy: &str| {
        let mut s = lb(name, json!({ "ipFamilyPolicy": policy }));
        s.metadata.annotations = Some([("vip.dev/pool".to_owned(), "v4".to_owned())].into());
        s
    };
    svcs.create(&pp, &to_v4("both", "RequireDualStack")).await.unwrap();
    svcs.create(&pp, &to_v4("either", "PreferDualStack")).await.unwrap();
    let (_lead, task) = run_controller(client.clone());
    let want = "both: RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: VipPool \"v4\" (vip.dev/pool) has no free IPv6 address";
    eventually("an AllocationFailed Event for both", || events(&api, "AllocationFailed") == [want]).await;
    eventually("either gets its IPv4 address", || !ingress(&api, "either").is_empty()).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ingress(&api, "both"), Vec::<IpAddr>::new(), "never half an answer");
    assert_eq!(families_of(&ingress(&api, "either")), ["IPv4"]);
    assert_eq!(events(&api, "AllocationFailed").len(), 1, "said once: {:?}", events(&api, "AllocationFailed"));

    // Services holding an address go first: either takes the first IPv6 address.
    let grown = json!({ "spec": { "addresses": ["198.18.2.10-198.18.2.11", "2001:2:0:2::10-2001:2:0:2::11"] } });
    pools.patch("v4", &PatchParams::default(), &Patch::Merge(grown)).await.unwrap();
    eventually("both gets both", || ingress(&api, "both").len() == 2).await;
    let ips = |list: [&str; 2]| list.map(|a| a.parse::<IpAddr>().unwrap()).to_vec();
    assert_eq!(ingress(&api, "either"), ips(["198.18.2.10", "2001:2:0:2::10"]));
    assert_eq!(ingress(&api, "both"), ips(["198.18.2.11", "2001:2:0:2::11"]));
    task.abort();
}

/// The server lets `ipFamilyPolicy` go from SingleStack to PreferDualStack (it adds
/// IPv6 to `ipFamilies` and a second clusterIP): the controller keeps the IPv4
/// address and adds an IPv6 one. Back to SingleStack (the server drops the
/// secondary family), the IPv6 address is released with an Event.
async fn a_service_upgraded_to_dual_stack_gets_its_second_address(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("dual", json!({ "addresses": DUAL }))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    svcs.create(&pp, &lb("web", json!({}))).await.unwrap();
    let (_lead, task) = run_controller(client.clone());
    eventually("web addressed", || !ingress(&api, "web").is_empty()).await;
    let v4 = ingress(&api, "web");
    assert_eq!(families_of(&v4), ["IPv4"]);

    let mp = PatchParams::default();
    svcs.patch("web", &mp, &Patch::Merge(json!({ "spec": { "ipFamilyPolicy": "PreferDualStack" } }))).await.unwrap();
    assert_eq!(server_families(&api, "web"), (json!(["IPv4", "IPv6"]), json!("PreferDualStack"), 2));
    eventually("web's second address", || ingress(&api, "web").len() == 2).await;
    let both = ingress(&api, "web");
    assert_eq!((both[0], families_of(&both)), (v4[0], vec!["IPv4", "IPv6"]), "the IPv4 address kept, IPv6 added");

    svcs.patch("web", &mp, &Patch::Merge(json!({ "spec": { "ipFamilyPolicy": "SingleStack" } }))).await.unwrap();
    assert_eq!(server_families(&api, "web"), (json!(["IPv4"]), json!("SingleStack"), 1));
    eventually("web's IPv6 address released", || ingress(&api, "web") == v4).await;
    let released = format!("web: {}: the address no longer fits the Service or its pool", both[1]);
    eventually("a Released Event", || events(&api, "Released") == [released.clone()]).await;
    task.abort();
}
