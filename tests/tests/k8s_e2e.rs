//! End to end with Kubernetes as the source: the API stand-in runs in a namespace
//! of the lab (198.18.0.2), three nodes run the real `vip-agent run --kubernetes`
//! with a kubeconfig pointing at it. A VipPool and a LoadBalancer Service are
//! created through the API: the elected agent allocates the Service an address,
//! the pool reports Ready with its counts, the address answers ARP from exactly
//! one node and connections to it spread over all three nodes.
use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::Path,
    sync::mpsc,
    time::Duration,
};

use serde_json::json;
use vip_tests::{
    agent::{agent_bin, wait_for, write_atomic, TempDir},
    apiserver::{ApiServer, ResourceSpec},
    halab::{ask, node_addr, vip, HaLab, HaSpec, Naming},
    netns::{privileged, NetNs},
};

const API_ADDR: &str = "198.18.0.2:6443";

/// Runs the stand-in inside `ns` (its runtime's threads live there) until the
/// returned sender is dropped.
fn api_in(ns: &NetNs) -> (ApiServer, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    ns.spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let api = rt
            .block_on(ApiServer::builder().resources(ResourceSpec::VIP).bind(API_ADDR.parse::<SocketAddr>().unwrap()).bookmark_interval(Duration::from_secs(1)).start())
            .unwrap();
        tx.send(api).unwrap();
        let _ = stop_rx.recv(); // keep the runtime (and the server) alive
    })
    .unwrap();
    (rx.recv().unwrap(), stop_tx)
}

fn kubeconfig(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: http://{API_ADDR}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: lab\n    namespace: vip-system\ncurrent-context: lab\nusers:\n- name: lab\n  user: {{}}\n"
    );
    write_atomic(&path, &text).unwrap();
    path
}

#[test]
fn service_gets_a_vip_that_answers_and_spreads_over_the_nodes() {
    if !privileged() {
        return;
    }
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let tmp = TempDir::new("vip-k8s-e2e-").unwrap();
    let spec = HaSpec { kubeconfig: Some(kubeconfig(&tmp.0)), ..Default::default() };
    // The agents start and wait for the API (their watches retry) while it comes up.
    let lab = HaLab::start(spec, Naming::Unique, Path::new(env!("CARGO_BIN_EXE_vip-lab"))).unwrap();
    let api_ns = lab.seg.plug(NetNs::new("vapi").unwrap(), "198.18.0.2/24").unwrap();
    let (api, _keep) = api_in(&api_ns);
    for (i, n) in lab.nodes.iter().enumerate() {
        api.insert("nodes", json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": n.name, "labels": { "lab": "yes" } },
            "status": {
                "addresses": [{ "type": "InternalIP", "address": node_addr(i).to_string() }],
                "conditions": [{ "type": "Ready", "status": "True" }]
            }
        }))
        .unwrap();
    }
    api.insert("vippools.vip.dev", json!({
        "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "lab" },
        "spec": { "addresses": [format!("{}-{}", vip(0), vip(2))], "nodeSelector": { "lab": "yes" }, "tableSize": 251,
                  "healthCheck": { "type": "http", "path": "/healthz", "interval": "200ms", "timeout": "100ms" } }
    }))
    .unwrap();
    api.insert("services", json!({
        "apiVersion": "v1", "kind": "Service", "metadata": { "name": "web", "namespace": "shop" },
        "spec": { "type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "ports": [{ "port": 80, "protocol": "TCP" }] }
    }))
    .unwrap();

    // The leader allocates the lowest address and reports the pool.
    let ip = wait_for(Duration::from_secs(20), || api.get("services", Some("shop"), "web")?["status"]["loadBalancer"]["ingress"][0]["ip"].as_str().map(str::to_owned));
    let ip = ip.unwrap_or_else(|| panic!("no address allocated\n{}", lab.agent_logs()));
    assert_eq!(ip, vip(0).to_string());
    let pool_ok = wait_for(Duration::from_secs(10), || {
        let p = api.get("vippools.vip.dev", None, "lab")?;
        let ready = p["status"]["conditions"].as_array()?.iter().any(|c| c["type"] == "Ready" && c["status"] == "True");
        (ready && p["status"]["allocated"] == 1 && p["status"]["free"] == 2).then_some(())
    });
    assert!(pool_ok.is_some(), "pool status: {:?}", api.get("vippools.vip.dev", None, "lab"));
    let lease = api.get("leases.coordination.k8s.io", Some("vip-system"), "vip-controller").expect("a Lease");
    assert!(lab.nodes.iter().any(|n| lease["spec"]["holderIdentity"] == n.name.as_str()), "{lease}");

    // Every agent built the same model and agrees on the owners; the VIP answers.
    let all: Vec<usize> = (0..lab.nodes.len()).collect();
    let owners = lab.wait_converged(&all, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e:#}\n{}", lab.agent_logs()));
    let v = vip(0);
    let mut seen = BTreeMap::<String, u32>::new();
    for p in 0..30 {
        *seen.entry(ask(&lab.client, v, 45000 + p, Duration::from_secs(2)).unwrap()).or_default() += 1;
    }
    assert_eq!(seen.keys().map(String::as_str).collect::<Vec<_>>(), ["node-1", "node-2", "node-3"], "{seen:?}");
    let owner_mac = lab.nodes[lab.index_of(&owners[&v])].mac;
    assert_eq!(lab.client_neigh(v), Some(owner_mac), "answered by its owner {}", owners[&v]);
    let events = api.list("events.events.k8s.io", None);
    assert!(events.iter().any(|e| e["reason"] == "Allocated" && e["regarding"]["name"] == "web"), "{events:?}");
    drop(lab);
}
