//! What the Kubernetes tests share: running a scenario against both API servers,
//! polling, and reading pools' conditions and Events back.
use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use vip_agent::k8s::crd::VipPool;

use crate::kubeapi::Backend;

/// `both_api_servers!(name)`: `name::stand_in` and `name::real` run
/// `async fn name(Backend)` against the in-process stand-in and a real
/// kube-apiserver (skipped without `KUBEBUILDER_ASSETS`, unless CI=true).
#[macro_export]
macro_rules! both_api_servers {
    ($name:ident) => {
        mod $name {
            use vip_tests::kubeapi::Backend;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stand_in() {
                super::$name(Backend::stand_in().await).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn real() {
                if let Some(b) = Backend::real().await {
                    super::$name(b).await
                }
            }
        }
    };
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
