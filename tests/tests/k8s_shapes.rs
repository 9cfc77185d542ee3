//! The cluster shapes users have, with Kubernetes as the source: the agents run
//! as deploy/20-daemonset.yaml runs them (`run --kubernetes`, its
//! `--metrics-addr`) and are probed as the kubelet probes a host-network pod (its
//! readiness and liveness probes on the node's primary InternalIP), which is what
//! `kubectl rollout status` waits on.
//!
//! - **kubeadm** (and kind): a control-plane Node labelled
//!   `node.kubernetes.io/exclude-from-external-load-balancers` and tainted
//!   `node-role.kubernetes.io/control-plane:NoSchedule` beside three workers. The
//!   DaemonSet tolerates the taint and has no affinity, so an agent runs there:
//!   it is Ready as idle, holds nothing and serves no VIP; a rolling restart of
//!   every agent, one at a time, finds each Ready again. A worker gaining the
//!   label gives up its VIP and leaves the rings while its pod stays Ready; the
//!   control plane losing it joins the rings (its taint still keeps VIPs off it).
//! - **IPv6-only**: IPv6 Node addresses, service CIDR and API server, no IPv4
//!   address on any host: the probes answer on the node's IPv6 address, an IPv6
//!   VIP is allocated, answered (NDP) and spread, and moves when its holder's
//!   agent dies.
//! - **dual-stack** (IPv4 primary): a `RequireDualStack` Service gets an address
//!   of each family; both are answered and spread, and each moves when its
//!   holder's agent dies.
//!
//! Each shape runs against the stand-in API server and, with `KUBEBUILDER_ASSETS`,
//! against a real kube-apiserver started with the shape's service CIDRs.
use std::{
    collections::BTreeSet,
    net::IpAddr,
    path::Path,
    sync::Mutex,
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use vip_tests::{
    agent::{agent_bin, wait_for},
    apiserver::Stack,
    daemonset::{pod_ready, AgentPod},
    halab::{ask, vip, vip6, HaSpec},
    kubelab::{KubeLab, Shape, CONTROL_PLANE_LABEL},
    netns::privileged,
};

/// One lab at a time (they would share the machine's cores).
static SERIAL: Mutex<()> = Mutex::new(());

const EXCLUDE: &str = vip_agent::k8s::source::EXCLUDE_FROM_LB_LABEL;

fn lab_exe() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_vip-lab"))
}

/// The lab's agents bind as the DaemonSet does and check ARP every second.
fn spec(nodes: usize) -> HaSpec {
    HaSpec { nodes, metrics_on_segment: true, arp_check_ms: Some(1000), ..HaSpec::default() }
}

/// Runs `f` on a lab of `shape` against the stand-in or (`real`) a real server.
fn with_lab(spec: HaSpec, shape: Shape, real: bool, f: impl FnOnce(&mut KubeLab, &Shape)) {
    if !privileged() {
        return;
    }
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    agent_bin().expect("the vip-agent binary (cargo xtask test builds it)");
    let mut kl = if real {
        KubeLab::start_real_shaped(spec, shape, lab_exe()).unwrap().expect("KUBEBUILDER_ASSETS")
    } else {
        KubeLab::start_shaped(spec, shape, lab_exe()).unwrap()
    };
    f(&mut kl, &shape);
}

#[test]
fn kubeadm_control_plane_stand_in() {
    with_lab(spec(4), Shape { stack: Stack::V4, control_planes: 1 }, false, kubeadm);
}

#[test]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
fn kubeadm_control_plane_real() {
    with_lab(spec(4), Shape { stack: Stack::V4, control_planes: 1 }, true, kubeadm);
}

#[test]
fn ipv6_only_stand_in() {
    with_lab(HaSpec { ipv6: true, ipv6_only: true, ..spec(3) }, Shape { stack: Stack::V6, control_planes: 0 }, false, ipv6_only);
}

#[test]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
fn ipv6_only_real() {
    with_lab(HaSpec { ipv6: true, ipv6_only: true, ..spec(3) }, Shape { stack: Stack::V6, control_planes: 0 }, true, ipv6_only);
}

#[test]
fn dual_stack_stand_in() {
    with_lab(HaSpec { ipv6: true, ..spec(3) }, Shape { stack: Stack::Dual, control_planes: 0 }, false, dual_stack);
}

#[test]
#[cfg_attr(not(real_apiserver), ignore = "needs KUBEBUILDER_ASSETS (kube-apiserver, etcd; docs/development/tests.md)")]
fn dual_stack_real() {
    with_lab(HaSpec { ipv6: true, ..spec(3) }, Shape { stack: Stack::Dual, control_planes: 0 }, true, dual_stack);
}

// ---- the shapes ----------------------------------------------------------------

fn kubeadm(kl: &mut KubeLab, shape: &Shape) {
    let pod = AgentPod::load().unwrap();
    assert!(pod.tolerates(CONTROL_PLANE_LABEL, "NoSchedule") && pod.affinity.is_null(), "the DaemonSet schedules an agent on the control plane: {pod:?}");
    let cp = kl.lab.nodes.len() - 1;
    let workers: Vec<usize> = (0..cp).collect();
    // The lab's node i is node-{i+1}.
    let names = |ix: &[usize]| ix.iter().map(|i| format!("node-{}", i + 1)).collect::<Vec<_>>();
    pool(kl, &[format!("{}-{}", vip(0), vip(2))]);
    service(kl, "web", json!({}));
    let v = IpAddr::V4(vip(0));
    assert_eq!(ingress(kl, "web", 1), [v]);

    let owners = kl.lab.wait_held(&workers, &[v], Duration::from_secs(15)).unwrap_or_else(|e| panic!("{e:#}\n{}", kl.lab.agent_logs()));
    let worker_names = names(&workers);
    assert!(worker_names.contains(&owners[&v]), "held by a worker: {owners:?}");
    spread(kl, v, &worker_names, 45000);
    assert!(kl.lab.status(cp).is_none_or(|s| s.held.is_empty()), "the control plane holds nothing");
    let cp_ready = ready_within(kl, shape, &pod, cp, Duration::from_secs(15));
    assert!(cp_ready.contains("idle"), "the control plane's agent is ready as idle: {cp_ready:?}");

    // A rolling update as maxUnavailable: 1 does it: each pod replaced and Ready
    // before the next (the control plane's included).
    for i in 0..kl.lab.nodes.len() {
        let t0 = Instant::now();
        kl.lab.stop_agent(i, libc::SIGTERM);
        kl.lab.start_agent(i).unwrap();
        ready_within(kl, shape, &pod, i, Duration::from_secs(30));
        eprintln!("rolling restart: {}'s agent Ready {:.1} s after it was stopped", kl.lab.nodes[i].name, t0.elapsed().as_secs_f64());
    }
    let owners = kl.lab.wait_held(&workers, &[v], Duration::from_secs(15)).unwrap_or_else(|e| panic!("after the roll: {e:#}\n{}", kl.lab.agent_logs()));

    // The holder's Node gains the label at run time: the VIP moves to another
    // worker, the rings drop it, its pod stays Ready.
    let h = kl.lab.index_of(&owners[&v]);
    label(kl, shape, h, EXCLUDE, true);
    let rest: Vec<usize> = workers.iter().copied().filter(|&i| i != h).collect();
    kl.lab.wait_held(&rest, &[v], Duration::from_secs(15)).unwrap_or_else(|e| panic!("{e:#}\n{}", kl.lab.agent_logs()));
    spread(kl, v, &names(&rest), 45100);
    ready_within(kl, shape, &pod, h, Duration::from_secs(5));

    // kubeadm users may let the control plane serve: without the label it is a
    // backend, and its taint (not tolerated by the pool) still keeps the VIP off it.
    label(kl, shape, cp, EXCLUDE, false);
    let mut backends = names(&rest);
    backends.push(kl.lab.nodes[cp].name.clone());
    backends.sort();
    spread(kl, v, &backends, 45200);
    let owners = kl.lab.wait_held(&rest, &[v], Duration::from_secs(10)).unwrap();
    assert_ne!(owners[&v], kl.lab.nodes[cp].name);
    label(kl, shape, h, EXCLUDE, false);
    let mut all = names(&(0..kl.lab.nodes.len()).collect::<Vec<_>>());
    all.sort();
    spread(kl, v, &all, 45300);
}

fn ipv6_only(kl: &mut KubeLab, shape: &Shape) {
    let pod = AgentPod::load().unwrap();
    for i in 0..kl.lab.nodes.len() {
        let ips = kl.lab.nodes[i].ns.ip(&["-4", "addr", "show", "dev", "eth0"]).unwrap();
        assert!(!String::from_utf8_lossy(&ips.stdout).contains("inet "), "an IPv4 address on an IPv6-only node");
        ready_within(kl, shape, &pod, i, Duration::from_secs(15));
    }
    pool(kl, &[format!("{}-{}", vip6(0), vip6(2))]);
    service(kl, "web", json!({}));
    let s = kl.api.get("services", Some("shop"), "web").unwrap();
    assert_eq!(s["spec"]["ipFamilies"], json!(["IPv6"]), "the server gives an IPv6-only cluster's Service IPv6");
    let v = IpAddr::V6(vip6(0));
    assert_eq!(ingress(kl, "web", 1), [v]);
    answered_spread_and_moved(kl, &[v]);
}

fn dual_stack(kl: &mut KubeLab, shape: &Shape) {
    let pod = AgentPod::load().unwrap();
    for i in 0..kl.lab.nodes.len() {
        ready_within(kl, shape, &pod, i, Duration::from_secs(15));
    }
    pool(kl, &[format!("{}-{}", vip(0), vip(2)), format!("{}-{}", vip6(0), vip6(2))]);
    service(kl, "web", json!({ "ipFamilyPolicy": "RequireDualStack" }));
    let (v4, v6) = (IpAddr::V4(vip(0)), IpAddr::V6(vip6(0)));
    assert_eq!(ingress(kl, "web", 2), [v4, v6], "one address of each family, the primary first");
    answered_spread_and_moved(kl, &[v4, v6]);
}

// ---- what a user sees --------------------------------------------------------------

/// `vips` are held by one agreed node each, answered by it, spread over every
/// node; then, VIP by VIP, the holder's agent is SIGKILLed: the VIP is held by
/// another node, answered by it and still spread; the agent comes back.
fn answered_spread_and_moved(kl: &mut KubeLab, vips: &[IpAddr]) {
    let all: Vec<usize> = (0..kl.lab.nodes.len()).collect();
    let every: Vec<String> = kl.lab.nodes.iter().map(|n| n.name.clone()).collect();
    let owners = kl.lab.wait_held(&all, vips, Duration::from_secs(20)).unwrap_or_else(|e| panic!("{e:#}\n{}", kl.lab.agent_logs()));
    for (k, v) in vips.iter().enumerate() {
        spread(kl, *v, &every, 45000 + 100 * k as u16);
        let mac = kl.lab.nodes[kl.lab.index_of(&owners[v])].mac;
        assert_eq!(kl.lab.client_neigh(*v), Some(mac), "{v} answered by its holder {}", owners[v]);
    }
    for (k, v) in vips.iter().enumerate() {
        let owners = kl.lab.wait_held(&all, vips, Duration::from_secs(20)).unwrap();
        let h = kl.lab.index_of(&owners[v]);
        let t0 = Instant::now();
        kl.lab.kill_agent(h);
        let up: Vec<usize> = all.iter().copied().filter(|&i| i != h).collect();
        let moved = kl.lab.wait_held(&up, &[*v], Duration::from_secs(10)).unwrap_or_else(|e| panic!("{v} did not move: {e:#}\n{}", kl.lab.agent_logs()));
        eprintln!("{v}: held by {} {:.2} s after {}'s agent was killed", moved[v], t0.elapsed().as_secs_f64(), owners[v]);
        // A fresh connection is answered through the new holder.
        let answered = wait_for(Duration::from_secs(5), || ask(&kl.lab.client, *v, 46000 + 100 * k as u16, Duration::from_secs(1)).ok());
        assert!(answered.is_some(), "{v} not answered after it moved\n{}", kl.lab.agent_logs());
        let mac = kl.lab.nodes[kl.lab.index_of(&moved[v])].mac;
        assert_eq!(kl.lab.client_neigh(*v), Some(mac), "{v} answered by its new holder {}", moved[v]);
        kl.lab.start_agent(h).unwrap();
        kl.lab
            .wait_held(&all, vips, Duration::from_secs(20))
            .unwrap_or_else(|e| panic!("{} did not rejoin: {e:#}\n{}", kl.lab.nodes[h].name, kl.lab.agent_logs()));
    }
}

/// 30 connections to `v` from consecutive ports from `base` reach exactly the
/// backends `want` (sorted), within 15 s of the rings settling.
fn spread(kl: &KubeLab, v: IpAddr, want: &[String], base: u16) {
    let mut want = want.to_vec();
    want.sort();
    let mut last = BTreeSet::new();
    let ok = wait_for(Duration::from_secs(15), || {
        last = (0..30).filter_map(|p| ask(&kl.lab.client, v, base + p, Duration::from_secs(2)).ok()).collect::<BTreeSet<String>>();
        (last.iter().cloned().collect::<Vec<_>>() == want).then_some(())
    });
    assert!(ok.is_some(), "connections to {v} reached {last:?}, not {want:?}\n{}", kl.lab.agent_logs());
}

/// Node `i`'s pod passes both kubelet probes within `limit`; the readiness body.
fn ready_within(kl: &KubeLab, shape: &Shape, pod: &AgentPod, i: usize, limit: Duration) -> String {
    let ip = shape.node_ips(i)[0];
    let mut last = None;
    let got = wait_for(limit, || match pod_ready(&kl.lab.nodes[i].ns, ip, pod) {
        Ok(body) => Some(body),
        Err(e) => {
            last = Some(format!("{e:#}"));
            None
        }
    });
    got.unwrap_or_else(|| panic!("{}'s pod not Ready within {limit:?} (probed at {ip}): {last:?}\n{}", kl.lab.nodes[i].name, kl.lab.agent_logs()))
}

/// Sets (or removes) label `key` on node `i`, as `kubectl label` would.
fn label(kl: &KubeLab, shape: &Shape, i: usize, key: &str, on: bool) {
    let name = kl.lab.nodes[i].name.clone();
    if kl.api.is_real() {
        kl.kubectl(&["label", "node", &name, &if on { format!("{key}=") } else { format!("{key}-") }]);
        return;
    }
    let mut n = kl.api.get("nodes", None, &name).unwrap_or_else(|| shape.node(kl.lab.nodes.len(), i));
    let labels = n["metadata"]["labels"].as_object_mut().expect("labels");
    if on {
        labels.insert(key.into(), "".into());
    } else {
        labels.remove(key);
    }
    kl.api.insert("nodes", n).unwrap();
}

/// The pool `lab` a new user would write: no node selector, defaults but a table
/// small enough for the lab and a quick health check.
fn pool(kl: &KubeLab, addresses: &[String]) {
    let p = json!({
        "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "lab" },
        "spec": { "addresses": addresses, "tableSize": 251,
                  "healthCheck": { "type": "http", "path": "/healthz", "interval": "200ms", "timeout": "100ms" } }
    });
    kl.api.insert("vippools.vip.dev", p).unwrap();
}

/// A Cluster-policy LoadBalancer Service `shop/NAME` on TCP 80 with `extra` in its spec.
fn service(kl: &KubeLab, name: &str, extra: Value) {
    let mut spec = json!({ "type": "LoadBalancer", "externalTrafficPolicy": "Cluster", "ports": [{ "port": 80, "protocol": "TCP" }] });
    spec.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    kl.api.insert("services", json!({ "apiVersion": "v1", "kind": "Service", "metadata": { "name": name, "namespace": "shop" }, "spec": spec })).unwrap();
}

/// The Service's `status.loadBalancer.ingress` once it has `n` addresses (20 s).
fn ingress(kl: &KubeLab, name: &str, n: usize) -> Vec<IpAddr> {
    let got = wait_for(Duration::from_secs(20), || {
        let s = kl.api.get("services", Some("shop"), name)?;
        let ips: Vec<IpAddr> = s["status"]["loadBalancer"]["ingress"].as_array()?.iter().filter_map(|i| i["ip"].as_str()?.parse().ok()).collect();
        (ips.len() == n).then_some(ips)
    });
    got.unwrap_or_else(|| panic!("{name}: not {n} address(es) within 20 s: {:?}\n{}", kl.api.get("services", Some("shop"), name), kl.lab.agent_logs()))
}
