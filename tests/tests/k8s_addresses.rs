//! Addresses as a real cluster expects them: a Service that stops being ours
//! gives its address back with a `Released` Event although the server itself
//! cleared its status (and `loadBalancerClass` cannot change while it stays a
//! LoadBalancer); a CIDR pool does not hand out its network and broadcast
//! addresses unless told to; an edited pool does not take a running Service's
//! address (kept, said in a condition and an Event).
//!
//! Every scenario runs against the in-process stand-in (`NAME::stand_in`) and a
//! real kube-apiserver (`NAME::real`, skipped without `KUBEBUILDER_ASSETS` unless
//! CI=true), as in k8s_controller.rs.
use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::api::core::v1::Service;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{json, Value};
use vip_agent::k8s::crd::VipPool;
use vip_tests::{
    kubeapi::Backend,
    kubefix::{events, eventually, pool_condition, run_controller, vip_pool},
};

vip_tests::both_api_servers!(a_service_that_stops_being_ours_releases_its_address);
vip_tests::both_api_servers!(cidr_pools_skip_network_and_broadcast_unless_asked);
vip_tests::both_api_servers!(edited_selectors_keep_a_running_services_address);

fn lb(name: &str, extra_spec: Value, labels: Value) -> Service {
    let mut spec = json!({ "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] });
    for (k, v) in extra_spec.as_object().into_iter().flatten() {
        spec[k] = v.clone();
    }
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": "shop", "labels": labels },
        "spec": spec
    }))
    .unwrap()
}

fn ips(api: &Backend) -> BTreeMap<String, String> {
    api.list("services", Some("shop"))
        .into_iter()
        .filter_map(|s| Some((s["metadata"]["name"].as_str()?.to_owned(), s["status"]["loadBalancer"]["ingress"][0]["ip"].as_str()?.to_owned())))
        .collect()
}

fn pool_status(api: &Backend, name: &str) -> Value {
    api.get("vippools.vip.dev", None, name).map(|p| p["status"].clone()).unwrap_or(Value::Null)
}

/// The real server clears `status.loadBalancer` itself on a type change away from
/// LoadBalancer and refuses a new `loadBalancerClass` (the stand-in does the same):
/// the controller still records the release, and the address serves another Service.
async fn a_service_that_stops_being_ours_releases_its_address(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    let mp = PatchParams::default();
    Api::<VipPool>::all(client.clone()).create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10-198.18.1.11"]}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    svcs.create(&pp, &lb("web", json!({"loadBalancerClass": "vip.dev/vip"}), json!({}))).await.unwrap();
    svcs.create(&pp, &lb("api", json!({}), json!({}))).await.unwrap();
    let (_lead, task) = run_controller(client.clone());
    eventually("web and api allocated", || ips(&api).len() == 2).await;
    let web_ip = ips(&api)["web"].clone();
    let api_ip = ips(&api)["api"].clone();
    // A third waits for an address.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    svcs.create(&pp, &lb("later", json!({}), json!({}))).await.unwrap();
    eventually("later waits", || events(&api, "AllocationFailed").iter().any(|e| e.starts_with("later: "))).await;

    // The class cannot change while the Service stays a LoadBalancer, from a class or from none.
    for (name, from) in [("web", "\"vip.dev/vip\""), ("api", "null")] {
        let err = svcs.patch(name, &mp, &Patch::Merge(json!({"spec": {"loadBalancerClass": "example.com/other"}}))).await.unwrap_err();
        let kube::Error::Api(s) = err else { panic!("{name}: {err}") };
        assert_eq!((s.code, s.reason.as_str()), (422, "Invalid"), "{name} (class was {from}): {s:?}");
        assert_eq!(s.message, format!("Service \"{name}\" is invalid: spec.loadBalancerClass: Invalid value: \"example.com/other\": may not change once set"));
    }

    // web becomes a ClusterIP Service: the server clears its status and its class.
    let web = svcs.patch("web", &mp, &Patch::Merge(json!({"spec": {"type": "ClusterIP"}}))).await.unwrap();
    assert_eq!(web.spec.as_ref().unwrap().load_balancer_class, None, "the class goes with the type");
    assert!(web.status.as_ref().and_then(|s| s.load_balancer.as_ref()).is_none_or(|lb| lb.ingress.as_ref().is_none_or(|i| i.is_empty())), "{:?}", web.status);
    eventually("Released Event for web", || events(&api, "Released") == [format!("web: {web_ip}: no longer a LoadBalancer of ours (type ClusterIP)")]).await;
    eventually("later gets web's address", || ips(&api).get("later") == Some(&web_ip)).await;
    // An address on a ClusterIP Service's status is refused.
    let err = svcs.patch_status("web", &mp, &Patch::Merge(json!({"status": {"loadBalancer": {"ingress": [{"ip": web_ip}]}}}))).await.unwrap_err();
    assert!(matches!(&err, kube::Error::Api(s) if s.code == 422 && s.message.contains("status.loadBalancer.ingress: Forbidden")), "{err}");

    // api goes to another class (through another type, as the server wants it).
    svcs.patch("api", &mp, &Patch::Merge(json!({"spec": {"type": "NodePort"}}))).await.unwrap();
    svcs.patch("api", &mp, &Patch::Merge(json!({"spec": {"type": "LoadBalancer", "loadBalancerClass": "example.com/other"}}))).await.unwrap();
    eventually("Released Event for api", || {
        events(&api, "Released").iter().any(|e| e.starts_with(&format!("api: {api_ip}: no longer a LoadBalancer of ours (")))
    })
    .await;
    eventually("api's address back in the pool", || {
        let st = pool_status(&api, "p");
        (st["allocated"].clone(), st["free"].clone()) == (json!(1), json!(1))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(events(&api, "Released").len(), 2, "one Event per release: {:?}", events(&api, "Released"));
    assert_eq!(ips(&api), BTreeMap::from([("later".to_owned(), web_ip)]), "no address for another class's Service");
    task.abort();
}

/// A /30 has two usable addresses; `includeNetworkAndBroadcast` gives all four.
async fn cidr_pools_skip_network_and_broadcast_unless_asked(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    let pools: Api<VipPool> = Api::all(client.clone());
    pools.create(&pp, &vip_pool("net", json!({"addresses": ["198.18.5.0/30"]}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    for n in ["s1", "s2", "s3"] {
        svcs.create(&pp, &lb(n, json!({}), json!({}))).await.unwrap();
    }
    let (_lead, task) = run_controller(client.clone());
    eventually("two allocated, one waits", || {
        ips(&api).len() == 2 && events(&api, "AllocationFailed").iter().any(|e| e.contains("no VipPool with autoAssign"))
    })
    .await;
    let mut got: Vec<String> = ips(&api).into_values().collect();
    got.sort();
    assert_eq!(got, ["198.18.5.1", "198.18.5.2"]);
    // The pool's status is written after the allocations, in the same pass or the next.
    eventually("two in the pool", || pool_status(&api, "net")["total"] == json!(2)).await;
    pools.patch("net", &PatchParams::default(), &Patch::Merge(json!({"spec": {"includeNetworkAndBroadcast": true}}))).await.unwrap();
    eventually("the third gets the network address", || ips(&api).len() == 3 && ips(&api).values().any(|a| a == "198.18.5.0")).await;
    eventually("four in the pool", || pool_status(&api, "net")["total"] == json!(4)).await;
    task.abort();
}

/// MetalLB keeps running configuration stale rather than breaking it: a pool whose
/// selectors no longer admit a Service leaves it its address, says so in a
/// `StaleAllocations` condition and one Event, and admits no new Service.
async fn edited_selectors_keep_a_running_services_address(api: Backend) {
    let client = api.client().await;
    let pp = PostParams::default();
    let pools: Api<VipPool> = Api::all(client.clone());
    pools.create(&pp, &vip_pool("p", json!({"addresses": ["198.18.1.10-198.18.1.11"]}))).await.unwrap();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "shop");
    svcs.create(&pp, &lb("web", json!({}), json!({"tier": "bronze"}))).await.unwrap();
    let (_lead, task) = run_controller(client.clone());
    eventually("web allocated", || ips(&api).get("web").map(String::as_str) == Some("198.18.1.10")).await;
    eventually("nothing stale", || pool_condition(&api, "p", "StaleAllocations").is_some_and(|c| c.0 == "False")).await;

    let gold = json!({"spec": {"serviceSelector": {"matchLabels": {"tier": "gold"}}}});
    pools.patch("p", &PatchParams::default(), &Patch::Merge(gold)).await.unwrap();
    eventually("stale condition", || pool_condition(&api, "p", "StaleAllocations").is_some_and(|c| c.0 == "True")).await;
    let (_, msg) = pool_condition(&api, "p", "StaleAllocations").unwrap();
    assert!(msg.contains("shop/web 198.18.1.10"), "{msg}");
    eventually("an Event", || !events(&api, "StaleAllocation").is_empty()).await;
    svcs.create(&pp, &lb("new", json!({}), json!({"tier": "bronze"}))).await.unwrap();
    eventually("the new one is not admitted", || events(&api, "AllocationFailed").iter().any(|e| e.starts_with("new: "))).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(ips(&api), BTreeMap::from([("web".to_owned(), "198.18.1.10".to_owned())]), "web keeps its address");
    assert!(events(&api, "Released").is_empty(), "{:?}", events(&api, "Released"));
    let stale = events(&api, "StaleAllocation");
    assert_eq!(stale.len(), 1, "one Event, not one per pass: {stale:?}");
    assert!(stale[0].starts_with("web: 198.18.1.10 kept although the selectors of VipPool \"p\" no longer admit this Service"), "{stale:?}");

    // web is relabelled to fit: nothing stale any more.
    svcs.patch("web", &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"tier": "gold"}}}))).await.unwrap();
    eventually("stale cleared", || pool_condition(&api, "p", "StaleAllocations").is_some_and(|c| c.0 == "False")).await;
    assert_eq!(ips(&api).get("web").map(String::as_str), Some("198.18.1.10"));
    task.abort();
}
