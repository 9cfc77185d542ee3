//! The HA lab with Kubernetes as the source: the API stand-in runs in a namespace
//! of the lab (198.18.0.2:6443) and every node runs `vip-agent run --kubernetes`
//! with a kubeconfig pointing at it. Shared by the Kubernetes e2e test and bench.
use std::{net::SocketAddr, path::Path, sync::mpsc};

use anyhow::Result;
use serde_json::json;

use crate::{
    agent::{write_atomic, TempDir},
    apiserver::{ApiServer, ResourceSpec},
    halab::{node_addr, HaLab, HaSpec, Naming},
    netns::NetNs,
};

pub const API_ADDR: &str = "198.18.0.2:6443";

pub struct KubeLab {
    // Drop order: the lab (agents) before the API and its namespace.
    pub lab: HaLab,
    pub api: ApiServer,
    /// Keeps the stand-in's runtime (in its namespace) running.
    _keep: mpsc::Sender<()>,
    pub api_ns: NetNs,
    _tmp: TempDir,
}

/// Runs the stand-in inside `ns` (its runtime's threads live there) until the
/// returned sender is dropped.
pub fn api_in(ns: &NetNs, addr: SocketAddr) -> Result<(ApiServer, mpsc::Sender<()>)> {
    let (tx, rx) = mpsc::channel();
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    ns.spawn(move || {
        let started = (|| -> Result<_> {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
            let api = rt.block_on(ApiServer::builder().resources(ResourceSpec::VIP).bind(addr).bookmark_interval(std::time::Duration::from_secs(1)).start())?;
            Ok((rt, api))
        })();
        match started {
            Ok((_rt, api)) => {
                let _ = tx.send(Ok(api));
                let _ = stop_rx.recv(); // keep the runtime (and the server) alive
            }
            Err(e) => {
                let _ = tx.send(Err(e));
            }
        }
    })?;
    Ok((rx.recv()??, stop_tx))
}

fn kubeconfig(dir: &Path) -> Result<std::path::PathBuf> {
    let path = dir.join("kubeconfig");
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n    server: http://{API_ADDR}\ncontexts:\n- name: lab\n  context:\n    cluster: lab\n    user: lab\n    namespace: vip-system\ncurrent-context: lab\nusers:\n- name: lab\n  user: {{}}\n"
    );
    write_atomic(&path, &text)?;
    Ok(path)
}

impl KubeLab {
    /// Starts the lab (agents in Kubernetes mode), the API in its namespace, and
    /// registers the lab's nodes as Ready Nodes labelled `lab=yes`.
    pub fn start(spec: HaSpec, server_exe: &Path) -> Result<Self> {
        let tmp = TempDir::new("vip-kube-lab-")?;
        let spec = HaSpec { kubeconfig: Some(kubeconfig(&tmp.0)?), ..spec };
        // The agents start and wait for the API (their watches retry) while it comes up.
        let lab = HaLab::start(spec, Naming::Unique, server_exe)?;
        let api_ns = lab.seg.plug(NetNs::new("vapi")?, "198.18.0.2/24")?;
        let (api, keep) = api_in(&api_ns, API_ADDR.parse()?)?;
        for (i, n) in lab.nodes.iter().enumerate() {
            api.insert("nodes", node_object(&n.name, &node_addr(i).to_string()))?;
        }
        Ok(Self { lab, api, _keep: keep, api_ns, _tmp: tmp })
    }
}

/// A Ready Node with its InternalIP, labelled `lab=yes`.
pub fn node_object(name: &str, ip: &str) -> serde_json::Value {
    json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": { "name": name, "labels": { "lab": "yes" } },
        "status": {
            "addresses": [{ "type": "InternalIP", "address": ip }],
            "conditions": [{ "type": "Ready", "status": "True" }]
        }
    })
}

/// An EndpointSlice of Service `svc` in `ns` with one ready endpoint on each of `nodes`.
pub fn endpoint_slice(ns: &str, svc: &str, nodes: &[&str]) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": { "name": format!("{svc}-1"), "namespace": ns, "labels": { "kubernetes.io/service-name": svc } },
        "addressType": "IPv4",
        "endpoints": nodes.iter().map(|n| serde_json::json!({ "addresses": ["10.0.0.1"], "nodeName": n, "conditions": { "ready": true } })).collect::<Vec<_>>()
    })
}

/// The backends in the ring of service `name` (`namespace/name`) as agent `i`'s
/// status reports them (written after its maps).
pub fn ring_backends(lab: &crate::halab::HaLab, i: usize, name: &str) -> Option<Vec<String>> {
    let s = lab.status(i)?;
    let svc = s["services"].as_array()?.iter().find(|x| x["name"] == name)?.clone();
    Some(svc["backends"].as_array()?.iter().filter_map(|b| b.as_str().map(str::to_owned)).collect())
}
