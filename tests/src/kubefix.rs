//! What the Kubernetes tests share: running a scenario against both API servers,
//! polling, and reading pools' conditions and Events back.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use vip_agent::k8s::crd::VipPool;

use http::Method;

use crate::{
    apiserver::{ApiServer, ResourceSpec, NOT_READY},
    kubeapi::{raw, Backend},
};

/// The elected controller (this process leading as "node-1", a 1 s resync, no
/// agents' view) on `client`: the sender keeps it leading while held.
pub fn run_controller(client: kube::Client) -> (tokio::sync::watch::Sender<bool>, tokio::task::JoinHandle<()>) {
    use vip_agent::k8s::controller;
    let (lead, leading) = tokio::sync::watch::channel(true);
    let task = tokio::spawn(controller::run(client, "node-1".into(), leading, Duration::from_secs(1), controller::AgentView::fixed(BTreeMap::new()).1));
    (lead, task)
}

/// `both_api_servers!(name)`: `name::stand_in` and `name::real` run
/// `async fn name(Backend)` against the in-process stand-in and a real
/// kube-apiserver (not run, and reported so, without `KUBEBUILDER_ASSETS` at build time), both
/// IPv4-only clusters. `both_api_servers!(name, Stack::Dual)`: both dual-stack.
#[macro_export]
macro_rules! both_api_servers {
    ($name:ident) => {
        $crate::both_api_servers!($name, Stack::V4);
    };
    ($name:ident, Stack::$stack:ident) => {
        mod $name {
            use $crate::kubeapi::{Backend, Stack};
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stand_in() {
                super::$name(Backend::stand_in_with(Stack::$stack).await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            #[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
            async fn real() {
                if let Some(b) = Backend::real_with(Stack::$stack).await {
                    super::$name(b).await
                }
            }
        }
    };
}

/// What the node lifecycle controller does once a Node is Ready: removes the
/// `node.kubernetes.io/not-ready` taint that admission put on it at creation (the
/// stand-in as the real server, see `apiserver/nodes.rs`), through the API. Returns the Node.
pub async fn lift_not_ready_taint(client: &kube::Client, node: &str) -> anyhow::Result<Value> {
    use anyhow::Context as _;
    let path = format!("/api/v1/nodes/{node}");
    let got = raw(client, Method::GET, &path, "", None).await?.ok()?;
    let taints = got["spec"]["taints"].as_array().cloned().unwrap_or_default();
    let keep: Vec<Value> = taints.iter().filter(|t| t["key"] != NOT_READY).cloned().collect();
    if keep.len() == taints.len() {
        return Ok(got);
    }
    let taints = if keep.is_empty() { Value::Null } else { Value::Array(keep) };
    let patch = json!({ "metadata": { "resourceVersion": got["metadata"]["resourceVersion"] }, "spec": { "taints": taints } });
    raw(client, Method::PATCH, &path, "application/merge-patch+json", Some(&patch)).await?.ok().context("removing the not-ready taint")
}

/// Polls `f` every 20 ms until it holds, at most `limit`; how long it took.
pub async fn eventually_within(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "not reached within {limit:?}: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    t0.elapsed()
}

/// A VipPool of these addresses, as JSON.
pub fn pool_json(name: &str, addresses: &[&str]) -> Value {
    json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name }, "spec": { "addresses": addresses } })
}

/// A LoadBalancer Service with one TCP port 80.
pub fn lb_json(ns: &str, name: &str) -> Value {
    json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": ns },
            "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] } })
}

/// A Service's first `status.loadBalancer` address.
pub fn ingress_ip(b: &Backend, ns: &str, name: &str) -> Option<String> {
    b.get("services", Some(ns), name)?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned)
}

/// [`eventually_within`] 20 s (generous: CI machines are slow and shared).
pub async fn eventually(what: &str, f: impl FnMut() -> bool) {
    eventually_within(Duration::from_secs(20), what, f).await;
}

/// A VipPool named `name` with `spec`.
pub fn vip_pool(name: &str, spec: Value) -> VipPool {
    serde_json::from_value(json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": name }, "spec": spec })).expect("a VipPool")
}

/// "namespace/name" → ingress IP of every Service, from the server's store.
pub fn ingress_ips(api: &Backend) -> BTreeMap<String, String> {
    api.list("services", None)
        .into_iter()
        .filter_map(|s| {
            let ip = s["status"]["loadBalancer"]["ingress"][0]["ip"].as_str()?.to_owned();
            Some((format!("{}/{}", s["metadata"]["namespace"].as_str()?, s["metadata"]["name"].as_str()?), ip))
        })
        .collect()
}

/// A pool's condition of `type_`: (status, message).
pub fn pool_condition(api: &Backend, pool: &str, type_: &str) -> Option<(String, String)> {
    let p = api.get("vippools.vip.dev", None, pool)?;
    let c = p["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == type_)?.clone();
    Some((c["status"].as_str()?.to_owned(), c["message"].as_str()?.to_owned()))
}

/// Events with `reason`, as "object: note".
pub fn events(api: &Backend, reason: &str) -> Vec<String> {
    api.list("events.events.k8s.io", None)
        .into_iter()
        .filter(|e| e["reason"] == reason)
        .map(|e| format!("{}: {}", e["regarding"]["name"].as_str().unwrap_or(""), e["note"].as_str().unwrap_or("")))
        .collect()
}

/// What [`outage_then_new_service`] saw.
#[derive(Debug)]
pub struct Outage {
    /// The first Service's address, before the outage.
    pub before: Option<String>,
    /// The Service created right after the restart: its address, and how long after
    /// the server was back it was written.
    pub after: Option<String>,
    pub addressed_after: Duration,
    /// During the outage: the election let go, `vip_kube_api_reachable` was 0, and
    /// how many errors `vip_kube_api_errors` counted.
    pub lost_leadership: bool,
    pub unreachable: bool,
    pub errors: u64,
    /// After the restart, until leading again and reachable again.
    pub leading_again_after: Duration,
    /// User-Agents the stand-in saw.
    pub user_agents: std::collections::BTreeSet<String>,
}

/// The agent's Kubernetes side (its election at default timing, 15 s lease and
/// 2 s retry, and its controller) against the stand-in: a first Service is
/// addressed; the server is stopped (listener closed) for `outage`, then served
/// again on the same address with its watch history compacted (a restarted
/// server's fresh watch cache: resumed watches get 410); a Service is created at
/// once. Fails only when the first Service never gets an address.
pub async fn outage_then_new_service(outage: Duration) -> anyhow::Result<Outage> {
    use vip_agent::k8s::{self, controller, leader};
    let lb = |name: &str| json!({"apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "shop" }, "spec": { "type": "LoadBalancer", "ports": [{ "port": 80, "protocol": "TCP" }] }});
    let mut api = ApiServer::builder().resources(ResourceSpec::VIP).bookmark_interval(Duration::from_millis(500)).start().await?;
    let ip = |api: &ApiServer, name: &str| api.get("services", Some("shop"), name)?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned);
    let client = k8s::client_from_config(kube::Config::new(api.url().parse()?))?;
    api.insert("namespaces", json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "shop"}}))?;
    api.insert(
        "vippools.vip.dev",
        json!({"apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": {"name": "pool"}, "spec": {"addresses": ["198.18.1.10-198.18.1.20"]}}),
    )?;
    let leading = leader::spawn(client.clone(), leader::LeaderConfig::new("vip-system", "node-1"));
    let task =
        tokio::spawn(controller::run(client, "node-1".into(), leading.clone(), Duration::from_secs(30), controller::AgentView::fixed(BTreeMap::new()).1));
    api.insert("services", lb("before"))?;
    eventually_within(Duration::from_secs(20), "the first Service addressed", || ip(&api, "before").is_some()).await;
    let health = k8s::api_health();
    let errors_before = health.errors.get();
    api.stop().await;
    tokio::time::sleep(outage).await;
    let (lost_leadership, unreachable, errors) = (!*leading.borrow(), health.reachable.get() == 0, health.errors.get() - errors_before);
    api.compact();
    api.restart().await?;
    let back = Instant::now();
    api.insert("services", lb("after"))?;
    let addressed_after = eventually_within(Duration::from_secs(60), "the new Service addressed", || ip(&api, "after").is_some()).await;
    eventually_within(Duration::from_secs(20), "leading and reachable again", || *leading.borrow() && health.reachable.get() == 1).await;
    let leading_again_after = back.elapsed();
    task.abort();
    Ok(Outage {
        before: ip(&api, "before"),
        after: ip(&api, "after"),
        addressed_after,
        lost_leadership,
        unreachable,
        errors,
        leading_again_after,
        user_agents: api.user_agents(),
    })
}
