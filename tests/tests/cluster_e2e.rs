//! The multi-node cluster harness (`vip_tests::cluster`) against itself: a real
//! cluster of 2 kubelet nodes (containerd, kube-proxy) and a control plane in
//! network namespaces, brought up, used and torn down.
//!
//! - every Node registers, gets a pod CIDR and goes Ready; the API server reaches
//!   each kubelet (`kubectl logs`);
//! - the `kubernetes` Service has the API server as its endpoint and answers TLS on
//!   its ClusterIP from every node (kube-proxy's DNAT);
//! - a 2-replica Deployment of the testpod server, one pod per node, behind a
//!   ClusterIP Service: both pods answer from every node and from the client
//!   (routed through node-1: DNAT, forwarding to the other node, masquerade), with
//!   kube-proxy in nftables mode, then again after switching it to iptables mode;
//! - after teardown nothing is left: processes, network namespaces, cgroups, the
//!   work directory, firewall rules or paths in the root namespace, sysctls.
//!
//! Skipped without root, `KUBEBUILDER_ASSETS`, `VIP_KUBE_NODE_ASSETS` or the
//! testpod image (`cargo xtask image`), except with CI=true.
use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use http::Method;
use serde_json::Value;
use vip_tests::{
    cluster::{self, converse, node_addr, Cluster, ClusterSpec, ProxyMode, CLUSTER_CIDR, CP_ADDR, KUBERNETES_SERVICE_IP, SERVICE_CIDR, TESTPOD_IMAGE},
    kubeapi::{client_from_kubeconfig, raw},
    netns::NetNs,
};

fn web_yaml() -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: web, namespace: default}}
spec:
  replicas: 2
  selector: {{matchLabels: {{app: web}}}}
  template:
    metadata: {{labels: {{app: web}}}}
    spec:
      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
          - labelSelector: {{matchLabels: {{app: web}}}}
            topologyKey: kubernetes.io/hostname
      containers:
      - name: serve
        image: {TESTPOD_IMAGE}
        imagePullPolicy: Never
        command: ["/vip-testpod", "serve", "--port", "8080"]
        ports: [{{containerPort: 8080}}]
        readinessProbe: {{tcpSocket: {{port: 8080}}, periodSeconds: 1}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: default}}
spec:
  selector: {{app: web}}
  ports: [{{port: 80, targetPort: 8080}}]
"#
    )
}

/// Whether `ip` is in the IPv4 `cidr`.
fn in_cidr(ip: &str, cidr: &str) -> bool {
    let (Ok(ip), Some((net, len))) = (ip.parse::<Ipv4Addr>(), cidr.split_once('/')) else { return false };
    let (Ok(net), Ok(len)) = (net.parse::<Ipv4Addr>(), len.parse::<u32>()) else { return false };
    let mask = u32::MAX.checked_shl(32 - len).unwrap_or(0);
    u32::from(ip) & mask == u32::from(net) & mask
}

fn items(v: &Value) -> Vec<Value> {
    v["items"].as_array().cloned().unwrap_or_default()
}

/// Connects to `addr` from `ns` until every pod in `want` has answered (its name
/// as the first line, then an echo), 100 connections at most: kube-proxy applies
/// changes at most once a second, so the first answers may all come from one pod.
fn reaches_all(ns: &NetNs, from: &str, addr: SocketAddr, want: &BTreeSet<String>) {
    let (mut seen, mut errors) = (BTreeSet::new(), Vec::new());
    let t0 = Instant::now();
    for i in 1..=100 {
        match converse(ns, addr, &["ping", "pong"]) {
            Ok(a) => {
                assert_eq!(a.echoes, ["ping", "pong"], "{from} -> {addr}: the echo of {}", a.pod);
                seen.insert(a.pod);
            }
            Err(e) => errors.push(format!("{e:#}")),
        }
        if &seen == want {
            eprintln!("{from} -> {addr}: both pods answered within {i} connections ({:.1} s)", t0.elapsed().as_secs_f64());
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("{from} -> {addr}: answered by {seen:?}, want {want:?}; errors: {errors:?}");
}

fn cluster_ip_answers(c: &Cluster, cip: Ipv4Addr, pods: &BTreeSet<String>) {
    let addr = SocketAddr::from((cip, 80));
    for n in c.nodes() {
        reaches_all(&n.ns, &n.name, addr, pods);
    }
    reaches_all(c.client(), "client (via node-1)", addr, pods);
}

#[test]
#[cfg_attr(not(real_cluster), ignore = "needs KUBEBUILDER_ASSETS and VIP_KUBE_NODE_ASSETS (a Kubernetes release's binaries; docs/development/tests.md)")]
fn cluster_up_cluster_ips_in_both_proxy_modes_and_clean_teardown() {
    let spec = ClusterSpec { images: vec![cluster::images_dir().join(cluster::TESTPOD_ARCHIVE)], ..Default::default() };
    if !cluster::available(&spec) {
        return;
    }
    let c = Cluster::start(spec).unwrap_or_else(|e| panic!("cluster: {e:#}"));
    let b = c.bring_up().clone();
    eprintln!("bring-up: {:.1} s to a ready cluster of {} nodes ({b:?})", b.total.as_secs_f64(), c.nodes().len());

    // Nodes: Ready, their address, a pod CIDR of the cluster's, no start-up taint.
    let nodes = items(&c.get("/api/v1/nodes").unwrap());
    assert_eq!(nodes.len(), 2, "{nodes:?}");
    for (i, n) in c.nodes().iter().enumerate() {
        let obj = nodes.iter().find(|o| o["metadata"]["name"] == n.name.as_str()).unwrap_or_else(|| panic!("no Node {}", n.name));
        assert_eq!(c.node_ready(&n.name).unwrap(), "True");
        let internal = obj["status"]["addresses"].as_array().unwrap().iter().find(|a| a["type"] == "InternalIP").unwrap()["address"].clone();
        assert_eq!(internal, node_addr(i).to_string(), "{}", n.name);
        let cidr = obj["spec"]["podCIDR"].as_str().unwrap();
        assert_eq!(cidr, n.pod_cidr());
        assert!(in_cidr(cidr.split('/').next().unwrap(), CLUSTER_CIDR) && cidr.ends_with("/24"), "{cidr}");
        let taints = obj["spec"]["taints"].as_array().cloned().unwrap_or_default();
        assert!(taints.is_empty(), "{}: {taints:?}", n.name);
    }

    // The kubernetes Service: the API server's address as its endpoint, TLS through
    // the ClusterIP from every node (kube-proxy's DNAT to 198.18.0.2:6443).
    let svc = c.get("/api/v1/namespaces/default/services/kubernetes").unwrap();
    assert_eq!(svc["spec"]["clusterIP"], KUBERNETES_SERVICE_IP.to_string());
    let slices = items(&c.get("/apis/discovery.k8s.io/v1/namespaces/default/endpointslices?labelSelector=kubernetes.io/service-name%3Dkubernetes").unwrap());
    let endpoints: Vec<(String, i64)> = slices
        .iter()
        .flat_map(|s| {
            let port = s["ports"][0]["port"].as_i64().unwrap_or(0);
            s["endpoints"].as_array().cloned().unwrap_or_default().into_iter().map(move |e| (e["addresses"][0].as_str().unwrap_or("").to_owned(), port))
        })
        .collect();
    assert_eq!(endpoints, [(CP_ADDR.to_string(), 6443)], "{slices:?}");
    let in_cluster = c.admin_kubeconfig_text(&format!("https://{KUBERNETES_SERVICE_IP}:443")).unwrap();
    for n in c.nodes() {
        let text = in_cluster.clone();
        let version =
            n.ns.run(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
                rt.block_on(async move {
                    let client = client_from_kubeconfig(&text).await?;
                    raw(&client, Method::GET, "/version", "", None).await?.ok()
                })
            })
            .unwrap()
            .unwrap_or_else(|e| panic!("{}: the kubernetes Service at {KUBERNETES_SERVICE_IP}:443: {e:#}", n.name));
        eprintln!("{}: kubernetes Service answers: {}", n.name, version["gitVersion"]);
        assert!(version["gitVersion"].as_str().unwrap().starts_with("v1."), "{version}");
    }

    // The testpod server, one pod per node, behind a ClusterIP.
    let t = Instant::now();
    c.apply_yaml(&web_yaml()).unwrap();
    c.wait_rollout("deployment/web", "default", Duration::from_secs(120)).unwrap();
    eprintln!("deployment web (2 replicas) available {:.1} s after apply", t.elapsed().as_secs_f64());
    let pods = items(&c.get("/api/v1/namespaces/default/pods?labelSelector=app%3Dweb").unwrap());
    assert_eq!(pods.len(), 2);
    let mut names = BTreeSet::new();
    let mut on = BTreeSet::new();
    for p in &pods {
        let (name, node, ip) = (p["metadata"]["name"].as_str().unwrap(), p["spec"]["nodeName"].as_str().unwrap(), p["status"]["podIP"].as_str().unwrap());
        let n = c.node_by_name(node).unwrap_or_else(|| panic!("{name} on an unknown node {node}"));
        assert!(in_cidr(ip, n.pod_cidr()), "{name}: {ip} not in {node}'s {}", n.pod_cidr());
        names.insert(name.to_owned());
        on.insert(node.to_owned());
        // The API server reaches the pod's kubelet (logs/exec).
        c.kubectl(&["logs", name]).unwrap_or_else(|e| panic!("kubectl logs {name} (on {node}): {e:#}"));
    }
    assert_eq!(on.len(), 2, "both pods on one node: {pods:?}");
    let cip: Ipv4Addr = c.get("/api/v1/namespaces/default/services/web").unwrap()["spec"]["clusterIP"].as_str().unwrap().parse().unwrap();
    assert!(in_cidr(&cip.to_string(), SERVICE_CIDR), "{cip}");
    // The client is a machine on the LAN: it reaches ClusterIPs through node-1.
    c.client().ip(&["route", "add", SERVICE_CIDR, "via", &node_addr(0).to_string()]).unwrap();

    cluster_ip_answers(&c, cip, &names);
    for n in c.nodes() {
        assert!(n.has_proxy_rules(ProxyMode::Nftables).unwrap() && !n.has_proxy_rules(ProxyMode::Iptables).unwrap(), "{}", n.name);
    }

    let took = c.set_proxy_mode(ProxyMode::Iptables).unwrap();
    eprintln!("kube-proxy switched to iptables mode on every node in {:.1} s", took.as_secs_f64());
    for n in c.nodes() {
        assert_eq!(n.proxy_mode(), ProxyMode::Iptables);
    }
    cluster_ip_answers(&c, cip, &names);

    let mut total = 0;
    for (what, bytes) in c.memory() {
        eprintln!("RSS {what:<40} {:>6.1} MiB", bytes as f64 / 1048576.0);
        total += bytes;
    }
    eprintln!("RSS total {:.0} MiB", total as f64 / 1048576.0);

    let footprint = c.footprint().clone();
    let t = Instant::now();
    drop(c);
    eprintln!("teardown: {:.1} s", t.elapsed().as_secs_f64());
    let left = footprint.leftovers();
    assert!(left.is_empty(), "left after teardown: {left:#?}");
}
