//! The agent's Kubernetes client after an API server outage (stand-in stopped, its
//! listener closed, then served again on the same address with its watch history
//! compacted, as a restarted server's fresh watch cache): every watch is back and a
//! Service created after the restart has its address within 5 s (kube-runtime's
//! default backoff, up to 30 s plus one more for the 410 that follows, took ~50 s).
//! Also: the reachability metric follows the outage, and requests name the agent in
//! their User-Agent.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use serde_json::json;
use vip_agent::k8s::{
    self, controller,
    leader::{self, LeaderConfig},
};
use vip_tests::{
    apiserver::{ApiServer, ResourceSpec},
    kubefix::eventually_within,
};

fn lb(name: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": { "name": name, "namespace": "shop" },
        "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }
    })
}

fn ingress_ip(api: &ApiServer, name: &str) -> Option<String> {
    api.get("services", Some("shop"), name)?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_service_is_addressed_within_5s_of_the_api_server_coming_back() {
    let mut api = ApiServer::builder().resources(ResourceSpec::VIP).bookmark_interval(Duration::from_millis(500)).start().await.unwrap();
    let client = k8s::client_from_config(kube::Config::new(api.url().parse().unwrap())).unwrap();
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}})).unwrap();
    api.insert(
        "vippools.vip.dev",
        json!({"apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": {"name": "pool"}, "spec": {"addresses": ["198.18.1.10-198.18.1.20"]}}),
    )
    .unwrap();
    // The agent's election (default timing: 15 s lease, 2 s retry) and controller.
    let leading = leader::spawn(client.clone(), LeaderConfig::new("vip-system", "node-1"));
    let controller = tokio::spawn(controller::run(
        client.clone(),
        "node-1".into(),
        leading.clone(),
        Duration::from_secs(30),
        controller::AgentView::fixed(BTreeMap::new()).1,
    ));
    api.insert("services", lb("before")).unwrap();
    eventually_within(Duration::from_secs(10), "the first Service addressed", || ingress_ip(&api, "before").is_some()).await;
    let health = k8s::api_health();
    assert_eq!(health.reachable.get(), 1);
    let errors_before = health.errors.get();

    // An outage longer than the lease: the leader stops leading, every watch fails.
    let outage = Duration::from_secs(16);
    api.stop().await;
    tokio::time::sleep(outage).await;
    assert!(!*leading.borrow(), "the leader still leads after a {outage:?} outage");
    assert_eq!(health.reachable.get(), 0, "vip_kube_api_reachable during the outage");
    let errors = health.errors.get() - errors_before;
    assert!(errors > 0, "no error counted during the outage");

    // Back, with the watch history gone: resumed watches get 410 and re-list.
    api.compact();
    api.restart().await.unwrap();
    let back = Instant::now();
    api.insert("services", lb("after")).unwrap();
    let took = eventually_within(Duration::from_secs(30), "the new Service addressed", || ingress_ip(&api, "after").is_some()).await;
    println!("resync: new Service addressed {:.2} s after the API server came back ({outage:?} outage, {errors} errors counted)", took.as_secs_f64());
    assert!(took <= Duration::from_secs(5), "new Service addressed {took:?} after the server came back (want ≤ 5 s)");
    assert_ne!(ingress_ip(&api, "after"), ingress_ip(&api, "before"));
    eventually_within(Duration::from_secs(5), "leading again", || *leading.borrow()).await;
    eventually_within(Duration::from_secs(5), "vip_kube_api_reachable back to 1", || health.reachable.get() == 1).await;
    println!("leading again and reachable {:.2} s after the server came back", back.elapsed().as_secs_f64());

    let agents = api.user_agents();
    assert_eq!(agents, [format!("vip-agent/{}", env!("CARGO_PKG_VERSION"))].into(), "User-Agents seen: {agents:?}");
    controller.abort();
}
