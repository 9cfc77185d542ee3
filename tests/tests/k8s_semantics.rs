//! What the Kubernetes source makes of objects as a real kube-apiserver writes
//! them: a new Node keeps admission's `node.kubernetes.io/not-ready` taint until the
//! node controller lifts it (this test plays the controller), `NetworkUnavailable`,
//! a cordon, the `exclude-from-external-load-balancers` label, and the health check
//! a Service gets (kube-proxy's health server for `externalTrafficPolicy: Cluster`,
//! the allocated `healthCheckNodePort` for `Local`).
//!
//! Runs against the in-process stand-in (`NAME::stand_in`), which taints new Nodes
//! and allocates `healthCheckNodePort`s as the real server does, and a real
//! kube-apiserver (`NAME::real`, skipped without `KUBEBUILDER_ASSETS` unless CI=true).
use http::Method;
use k8s_openapi::api::core::v1::{Node, Service};
use serde_json::{json, Value};
use vip_agent::{
    k8s::{
        crd::VipPool,
        source::{world_from, KUBE_PROXY_HEALTHZ_PORT},
    },
    model::{Probe, World},
};
use vip_tests::{
    kubeapi::{raw, Backend},
    kubefix::lift_not_ready_taint,
};

const MERGE: &str = "application/merge-patch+json";

fn status(ip: &str, network_unavailable: bool) -> Value {
    json!({ "status": {
        "addresses": [{ "type": "InternalIP", "address": ip }],
        "conditions": [
            { "type": "NetworkUnavailable", "status": if network_unavailable { "True" } else { "False" }, "reason": "Test", "message": "" },
            { "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status" }
        ]
    } })
}

async fn call(client: &kube::Client, method: Method, path: &str, body: Option<Value>) -> Value {
    let ct = if method == Method::POST { "application/json" } else { MERGE };
    raw(client, method.clone(), path, ct, body.as_ref()).await.unwrap().ok().unwrap_or_else(|e| panic!("{method} {path}: {e:#}"))
}

fn items<T: serde::de::DeserializeOwned>(list: Value, keep: impl Fn(&Value) -> bool) -> Vec<T> {
    list["items"].as_array().unwrap().iter().filter(|v| keep(v)).map(|v| serde_json::from_value(v.clone()).unwrap()).collect()
}

vip_tests::both_api_servers!(nodes_and_services_become_the_model);

async fn nodes_and_services_become_the_model(api: Backend) {
    let client = &api.client().await;
    let nodes = ["sem-fresh", "sem-ready", "sem-cordoned", "sem-nonet", "sem-excluded"];
    for n in nodes {
        let _ = raw(client, Method::DELETE, &format!("/api/v1/nodes/{n}"), "", None).await;
    }
    for (k, n) in nodes.iter().enumerate() {
        let mut labels = json!({ "kubernetes.io/hostname": n, "kubernetes.io/os": "linux" });
        if *n == "sem-excluded" {
            labels["node.kubernetes.io/exclude-from-external-load-balancers"] = "".into();
        }
        call(client, Method::POST, "/api/v1/nodes", Some(json!({ "apiVersion": "v1", "kind": "Node", "metadata": { "name": n, "labels": labels } }))).await;
        call(client, Method::PATCH, &format!("/api/v1/nodes/{n}/status"), Some(status(&format!("198.18.7.{}", k + 1), *n == "sem-nonet"))).await;
        let got = call(client, Method::GET, &format!("/api/v1/nodes/{n}"), None).await;
        assert_eq!(got["spec"]["taints"][0]["key"], "node.kubernetes.io/not-ready", "admission taints every new Node: {got}");
        // The node controller lifts the taint once it has seen Ready, and taints a cordoned node.
        match *n {
            "sem-fresh" => continue,
            "sem-cordoned" => {
                let cordon = json!({ "spec": { "unschedulable": true, "taints": [{ "key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule" }] } });
                call(client, Method::PATCH, &format!("/api/v1/nodes/{n}"), Some(cordon)).await
            }
            _ => lift_not_ready_taint(client, n).await.unwrap(),
        };
    }
    let pool = json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "sem" },
        "spec": { "addresses": ["198.18.8.10-198.18.8.20"], "nodeSelector": { "kubernetes.io/os": "linux" },
                  "healthCheck": { "type": "http", "interval": "1s", "timeout": "500ms" } } });
    call(client, Method::POST, "/apis/vip.dev/v1alpha1/vippools", Some(pool)).await;
    for (name, policy, ip) in [("web", "Cluster", "198.18.8.10"), ("local", "Local", "198.18.8.11")] {
        let svc = json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "shop" },
            "spec": { "type": "LoadBalancer", "externalTrafficPolicy": policy, "ports": [{ "port": 443, "protocol": "TCP" }] } });
        call(client, Method::POST, "/api/v1/namespaces/shop/services", Some(svc)).await;
        let ingress = json!({ "status": { "loadBalancer": { "ingress": [{ "ip": ip }] } } });
        call(client, Method::PATCH, &format!("/api/v1/namespaces/shop/services/{name}/status"), Some(ingress)).await;
    }

    let ours = |v: &Value| v["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("sem-"));
    let k_nodes: Vec<Node> = items(call(client, Method::GET, "/api/v1/nodes", None).await, ours);
    let k_pools: Vec<VipPool> = items(call(client, Method::GET, "/apis/vip.dev/v1alpha1/vippools", None).await, |_| true);
    let k_svcs: Vec<Service> = items(call(client, Method::GET, "/api/v1/namespaces/shop/services", None).await, |_| true);
    let w = world_from(&k_nodes, &k_pools, &k_svcs, &[], &World::default());

    let names = |ns: Vec<&vip_agent::model::Node>| ns.into_iter().map(|n| n.name.clone()).collect::<Vec<_>>();
    assert_eq!(names(w.nodes.iter().collect()), ["sem-cordoned", "sem-ready"], "still not-ready-tainted, no network and excluded nodes are left out");
    assert_eq!(names(w.eligible(&w.pools[0])), ["sem-cordoned", "sem-ready"], "a cordoned node keeps holding VIPs");
    let web = w.services.iter().find(|s| s.name == "shop/web").unwrap();
    let local = w.services.iter().find(|s| s.name == "shop/local").unwrap();
    assert_eq!(names(w.backend_candidates(web)), ["sem-cordoned", "sem-ready"], "and stays a backend");
    assert_eq!(web.health.as_ref().unwrap().probe, Probe::Http { port: KUBE_PROXY_HEALTHZ_PORT, path: "/healthz".into() });
    let hcnp = k_svcs.iter().find(|s| s.metadata.name.as_deref() == Some("local")).unwrap().spec.as_ref().unwrap().health_check_node_port.unwrap();
    assert_eq!(local.health.as_ref().unwrap().probe, Probe::Http { port: hcnp as u16, path: "/healthz".into() });

    // The node controller lifts the fresh node's taint: it joins.
    lift_not_ready_taint(client, "sem-fresh").await.unwrap();
    let k_nodes: Vec<Node> = items(call(client, Method::GET, "/api/v1/nodes", None).await, ours);
    let w = world_from(&k_nodes, &k_pools, &k_svcs, &[], &World::default());
    assert_eq!(names(w.eligible(&w.pools[0])), ["sem-cordoned", "sem-fresh", "sem-ready"]);

    for n in nodes {
        let _ = raw(client, Method::DELETE, &format!("/api/v1/nodes/{n}"), "", None).await;
    }
}
