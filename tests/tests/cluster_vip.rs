//! vip as its users run it: on a real cluster (`vip_tests::cluster`: kube-apiserver,
//! controller manager, scheduler, two kubelet nodes with containerd and kube-proxy,
//! joined by a bridge over veth links as kind's nodes are), installed with
//! `kubectl apply -k deploy/` and the image `cargo xtask image` builds, exactly as
//! docs/install/kubernetes.md says. One scenario, in order:
//!
//! 1. install: every agent pod Ready, with only the capabilities the manifest
//!    grants, its maps pinned on the node's bpffs, XDP attached (generic: `auto`
//!    on a veth), the heartbeat key Secret created, the pod's memory within its
//!    limit (the node's first agent: it creates the maps);
//! 2. a LoadBalancer Service (externalTrafficPolicy Cluster) backed by a pod on
//!    each node: its address allocated, connections from the client reach pods
//!    through vip's XDP on the holder (forwarded to the other node and passed to
//!    its own stack) and kube-proxy, in nftables and then iptables mode;
//! 3. externalTrafficPolicy Local: only the node with a ready pod is in the ring
//!    (kube-proxy's healthCheckNodePort), every connection succeeds; a pod started
//!    on the other node while kube-proxy there is stopped keeps that node out of
//!    the ring (no connection fails) until kube-proxy runs again, then it joins;
//! 4. failover: the holder's vip pod killed, then the holder's link cut, with a
//!    client load running: the VIP moves, new connections resume, long-lived ones
//!    served by the surviving node keep working; the cut node goes NotReady and is
//!    tainted by the controller manager; when its link returns it is Ready again
//!    and vip takes it back; a node whose kubelet stops (agent and pods running)
//!    goes NotReady, and vip moves its VIP and drops it from the ring until it is
//!    Ready again, with no new connection failing;
//! 5. upgrades under load: `kubectl rollout restart` and an image change: no new
//!    connection fails and no long-lived connection breaks; and from the first
//!    frame to a VIP to here, no node's stack routed one back to the holder (a
//!    counter on the segment's bridge; every node has route_guard's rule and the
//!    VIP's blackhole route from the Service's start);
//!    then kubeadm's control-plane label and taint put on the holder's Node: the
//!    VIP moves off it and a rolling restart completes; removed, it is a backend
//!    again;
//! 6. uninstall: `kubectl delete -k deploy/` and deploy/cleanup/ leave no XDP
//!    program attached and no pins on any node;
//! 7. teardown of the harness leaves nothing: processes, network namespaces,
//!    cgroups, the work directory, firewall rules or paths in the root
//!    namespace, sysctls.
//!
//! Before 1, the harness is checked (`the_harness_holds`): one real cluster
//! serves the whole scenario, rather than a second one booted to check itself.
use std::{collections::BTreeSet, net::Ipv4Addr, time::Duration};

use http::Method;
use serde_json::Value;
use vip_tests::{
    cluster::{self, node_addr, Cluster, ClusterSpec, ProxyMode, CLUSTER_CIDR, CP_ADDR, KUBERNETES_SERVICE_IP},
    kubeapi::{client_from_kubeconfig, deploy_dir, raw},
    vipcluster::{self as vc, Load},
};

const SECOND: Duration = Duration::from_secs(1);

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Capability bits (include/uapi/linux/capability.h) the manifest grants.
const CAP_NET_ADMIN: u32 = 12;
const CAP_NET_RAW: u32 = 13;
const CAP_BPF: u32 = 39;

/// The effective capabilities of the agent container on node `i` (from its task's
/// /proc status: the pid ctr reports for the container id the pod status names).
fn agent_caps(c: &Cluster, i: usize) -> u64 {
    let id = vc::agent_container_id(c, &c.node(i).name).unwrap();
    let tasks = stdout(&c.node(i).ctr(&["tasks", "ls"]).unwrap());
    let pid = tasks.lines().find(|l| l.starts_with(&id)).and_then(|l| l.split_whitespace().nth(1)).unwrap_or_else(|| panic!("no task {id}:\n{tasks}"));
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let hex = st.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    u64::from_str_radix(hex, 16).unwrap()
}

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
/// The harness itself, before vip is installed: every Node Ready with its
/// address, a pod CIDR of the cluster's and no start-up taint; the `kubernetes`
/// Service with the API server as its endpoint, answering TLS on its ClusterIP
/// from every node (kube-proxy's DNAT), which is how installed agents reach it.
fn the_harness_holds(c: &Cluster) {
    // Nodes: Ready, their address, a pod CIDR of the cluster's, no start-up taint.
    let nodes = items(&c.get("/api/v1/nodes").unwrap());
    assert_eq!(nodes.len(), c.nodes().len(), "{nodes:?}");
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
}

#[test]
#[cfg_attr(not(real_cluster), ignore = "needs KUBEBUILDER_ASSETS and VIP_KUBE_NODE_ASSETS (a Kubernetes release's binaries; docs/development/tests.md)")]
fn vip_installed_with_kubectl_apply_k_serves_fails_over_upgrades_and_uninstalls() {
    let spec = ClusterSpec::default();
    if !cluster::available(&spec) {
        return;
    }
    let c = Cluster::start(spec).expect("the cluster");
    eprintln!("cluster up: {:?}", c.bring_up());
    let n = c.nodes().len();

    // 0. The harness: one cluster serves the whole scenario, so it is checked here.
    the_harness_holds(&c);

    // 1. Install.
    let took = vc::install(&c).unwrap_or_else(|e| panic!("{e:#}"));
    eprintln!("cluster-vip: install: every agent Ready {:.1} s after kubectl apply -k deploy/", took.as_secs_f64());
    let pods = vc::agent_pods(&c).unwrap();
    assert_eq!(pods.len(), n, "one agent pod per node: {:?}", pods.keys());
    let want_caps = (1u64 << CAP_NET_ADMIN) | (1 << CAP_NET_RAW) | (1u64 << CAP_BPF);
    let (limit, memory) = vc::agent_memory(&c).unwrap();
    for (i, m) in memory.iter().enumerate() {
        let node = c.node(i);
        let pod = &pods[&node.name];
        assert_ne!(pod["spec"]["containers"][0]["securityContext"]["privileged"], true, "the agent runs unprivileged");
        assert_eq!(agent_caps(&c, i), want_caps, "{}: the agent's effective capabilities are the manifest's BPF, NET_ADMIN, NET_RAW", node.name);
        let pins = stdout(&node.exec(&["ls", "/sys/fs/bpf/vip"]).unwrap());
        assert!(pins.contains("lb_flows") && pins.contains("links"), "{}: pins in the node's bpffs: {pins}", node.name);
        let link = stdout(&node.exec(&["ip", "-d", "link", "show", "eth0"]).unwrap());
        assert!(link.contains("xdpgeneric"), "{}: auto mode on a veth attaches generic XDP: {link}", node.name);
        let mib = |b: u64| b as f64 / 1048576.0;
        eprintln!("cluster-vip: memory: {} agent pod {:.1} MiB now, {:.1} MiB peak (limit {:.0} MiB)", m.node, mib(m.now), mib(m.peak), mib(limit));
        assert!(m.peak < limit, "{}: the agent pod peaked at {} bytes, its limit is {limit}", m.node, m.peak);
    }
    let secret = c.get("/api/v1/namespaces/vip-system/secrets/vip-heartbeat").expect("the agents created the heartbeat key Secret");
    assert!(secret["data"]["key"].is_string());

    // 2. A Cluster-policy Service: spread over both nodes, in both kube-proxy modes.
    // As the README's quick start: the example pool with the segment's free
    // addresses, the example Service as written (its pods: a Deployment app=web).
    // From the first frame to a VIP: none may be routed back by a node's stack
    // (see the end of the scenario).
    c.segment().count_routed(vc::POOL_PREFIX).unwrap();
    vc::apply_pool(&c).unwrap();
    vc::apply_deployment(&c, "web", n, None).unwrap();
    vc::apply_example_service(&c).unwrap();
    let vip = vc::wait_vip(&c, "web", 30 * SECOND).unwrap();
    let holder = vc::holder(&c, vip, 30 * SECOND).unwrap();
    for node in c.nodes() {
        vc::poll(&format!("{}: the VIP's blackhole route behind `iif eth0`", node.name), 10 * SECOND, || {
            let rules = stdout(&node.exec(&["ip", "rule", "show"])?);
            let routes = stdout(&node.exec(&["ip", "route", "show", "table", "7473"])?);
            Ok((rules.contains("iif eth0 lookup 7473") && routes.contains(&format!("blackhole {vip}"))).then_some(()))
        })
        .unwrap();
    }
    let h = c.nodes().iter().position(|x| x.name == holder).unwrap();
    for mode in [ProxyMode::Nftables, ProxyMode::Iptables] {
        if c.node(0).proxy_mode() != mode {
            c.set_proxy_mode(mode).unwrap();
        }
        let before = (
            vc::metric(&c, h, "vip_xdp_packets", &["reason=\"forwarded\""]).unwrap(),
            vc::metric(&c, h, "vip_xdp_packets", &["reason=\"passed_local_backend\""]).unwrap(),
        );
        // kube-proxy applies a change within a second: until every node's rules name
        // both pods, a fresh rule set may miss or send everything to one.
        vc::poll("both pods answering through the VIP", 20 * SECOND, || Ok(vc::spread(&c, vip, 10).ok().filter(|s| s.len() == n))).unwrap();
        let seen = vc::spread(&c, vip, 60).unwrap_or_else(|e| panic!("{}: {e:#}\n{}", mode.as_str(), c.diagnose()));
        let after = (
            vc::metric(&c, h, "vip_xdp_packets", &["reason=\"forwarded\""]).unwrap(),
            vc::metric(&c, h, "vip_xdp_packets", &["reason=\"passed_local_backend\""]).unwrap(),
        );
        eprintln!(
            "cluster-vip: kube-proxy {}: 60 connections to {vip} answered by {seen:?}; holder {holder} forwarded {} frames, passed {} to its own stack",
            mode.as_str(),
            after.0 - before.0,
            after.1 - before.1
        );
        assert_eq!(seen.len(), n, "{}: every pod answers: {seen:?}", mode.as_str());
        assert!(after.0 > before.0 && after.1 > before.1, "{}: the holder's XDP both forwards to the other node and passes to its own", mode.as_str());
    }

    // 3. Local policy: only the node with a ready pod is a backend.
    let only = c.node(0).name.clone();
    vc::apply_web(&c, "local", 1, "Local", Some(&only)).unwrap();
    let lvip = vc::wait_vip(&c, "local", 30 * SECOND).unwrap();
    let lh = c.nodes().iter().position(|x| x.name == vc::holder(&c, lvip, 30 * SECOND).unwrap()).unwrap();
    let ring = |c: &Cluster| -> Option<BTreeSet<String>> {
        let s = vc::status(c, lh).ok()?;
        s.services.iter().find(|x| x.vip == lvip).map(|x| x.backends.iter().cloned().collect())
    };
    vc::poll("the Local Service's ring holding only the node with its pod", 30 * SECOND, || Ok(ring(&c).filter(|r| *r == BTreeSet::from([only.clone()]))))
        .unwrap();
    // A SYN that reaches the node before kube-proxy's rule for the new address
    // leaves a conntrack entry without DNAT that its retransmits follow: poll with
    // fresh connections, as for the Cluster Service.
    vc::poll("the Local Service answering through kube-proxy", 20 * SECOND, || Ok(vc::spread(&c, lvip, 1).ok())).unwrap();
    let seen = vc::spread(&c, lvip, 40).unwrap_or_else(|e| panic!("Local: {e:#}\n{}", c.diagnose()));
    assert_eq!(seen.values().sum::<usize>(), 40);

    // A node whose endpoint becomes ready joins the ring only when kube-proxy there
    // says it has it (the EndpointSlice reaches the agents first). kube-proxy on the
    // other node is stopped (its rules stay: no local endpoint, so the VIP's traffic
    // there is dropped) while a pod of the Service starts on it.
    let j = (0..n).find(|i| c.node(*i).name != only).unwrap();
    let joiner = c.node(j).name.clone();
    let hc = c.get("/api/v1/namespaces/default/services/local").unwrap()["spec"]["healthCheckNodePort"].as_u64().unwrap();
    let check = format!("http:{hc}/healthz");
    // The first node's own endpoint joined too: from a ring it holds as healthy
    // (while every backend is joining they all get the traffic).
    vc::poll(&format!("{only} healthy in every agent"), 30 * SECOND, || {
        Ok((0..n).all(|i| vc::status(&c, i).is_ok_and(|s| s.health.iter().any(|h| h.node == only && h.check == check && h.healthy))).then_some(()))
    })
    .unwrap();
    assert!(c.node(j).stop_proxy(), "{joiner}: kube-proxy was running");
    vc::apply_pod(&c, "local-join", "local", &joiner).unwrap();
    let pending = |c: &Cluster, i: usize| {
        vc::status(c, i).is_ok_and(|s| {
            s.health.iter().any(|h| h.node == joiner && h.check == check && !h.healthy)
                && s.services.iter().any(|x| x.vip == lvip && x.backends == [only.clone()])
        })
    };
    // From the moment an agent has the endpoint (it probes its node): a node that
    // joined at once would be in the ring until `fall` probes had failed.
    let probed = |c: &Cluster, i: usize| vc::status(c, i).is_ok_and(|s| s.health.iter().any(|h| h.node == joiner && h.check == check));
    vc::poll("every agent probing the new endpoint's node", 30 * SECOND, || Ok((0..n).all(|i| probed(&c, i)).then_some(()))).unwrap();
    assert!(
        (0..n).all(|i| pending(&c, i)),
        "{joiner} is in no ring when its endpoint is first seen: {:?}",
        (0..n).map(|i| vc::status(&c, i).ok()).collect::<Vec<_>>()
    );
    for round in 0..4 {
        let seen = vc::spread(&c, lvip, 10).unwrap_or_else(|e| panic!("Local, {joiner} joining: {e:#}\n{}", vc::agent_logs(&c)));
        assert!(seen.keys().all(|p| p.starts_with("local-") && p != "local-join"), "only the ready node's pod answers: {seen:?}");
        assert!((0..n).all(|i| pending(&c, i)), "round {round}: {joiner} stays out of the ring while its kube-proxy is stopped");
        std::thread::sleep(SECOND / 2);
    }
    let synced = c.node(j).start_proxy(c.node(j).proxy_mode()).unwrap();
    let t0 = std::time::Instant::now();
    vc::poll(&format!("{joiner} in the Local ring after its kube-proxy started"), 20 * SECOND, || {
        Ok((0..n).all(|i| vc::status(&c, i).is_ok_and(|s| s.services.iter().any(|x| x.vip == lvip && x.backends.contains(&joiner)))).then_some(()))
    })
    .unwrap();
    let seen = vc::spread(&c, lvip, 30).unwrap_or_else(|e| panic!("Local after {joiner} joined: {e:#}\n{}", vc::agent_logs(&c)));
    eprintln!("cluster-vip: Local: {joiner} joined {:?} after its kube-proxy synced ({synced:?} after starting); 30 connections: {seen:?}", t0.elapsed());
    assert!(seen.contains_key("local-join"), "the joined node's pod answers: {seen:?}");
    c.kubectl(&["-n", "default", "delete", "pod", "local-join", "--wait=true"]).unwrap();

    // 4. Failover: a killed agent pod, then a cut link, under load.
    c.kubectl(&["-n", "default", "delete", "deployment", "local"]).unwrap();
    c.kubectl(&["-n", "default", "delete", "service", "local"]).unwrap();
    vc::apply_web(&c, "web", n, "Local", None).unwrap();
    vc::wait_local_synced(&c, "web", 30 * SECOND).unwrap();
    let f = vc::kill_agent_trial(&c, "web", vip).unwrap();
    eprintln!("cluster-vip: failover (agent pod SIGKILL on {}, then {:?} held it): {:?}, killed at {:?}", f.victim, f.new_holder, f.load, f.fault_at);
    f.survivors_kept(&c, "agent pod killed").unwrap();
    assert!(f.load.longest_gap < 5 * SECOND, "agent pod killed: new connections stopped for {:?}", f.load.longest_gap);

    let f = vc::cut_link_trial(&c, "web", vip).unwrap();
    eprintln!(
        "cluster-vip: failover (link of {} cut at {:?}, the VIP moved to {:?}): longest gap without a new connection {:?} ending at {:?}; {:?}",
        f.victim, f.fault_at, f.new_holder, f.load.longest_gap, f.load.gap_end, f.load
    );
    f.survivors_kept(&c, "link cut").unwrap();
    assert!(f.load.longest_gap < 3 * SECOND, "link cut: new connections stopped for {:?}", f.load.longest_gap);
    let not_ready = vc::wait_cut_node_tainted(&c, &f.victim).unwrap();
    eprintln!("cluster-vip: {} NotReady (Unknown) and tainted {not_ready:?} after its VIP had moved", f.victim);
    let back = vc::restore_link(&c, &f.victim, vip).unwrap_or_else(|e| panic!("restoring {}'s link: {e:#}\n{}", f.victim, vc::agent_logs(&c)));
    eprintln!("cluster-vip: {} back: {back:?}", f.victim);

    // A node whose kubelet stops (its agent and pods keep running): the controller
    // manager marks it NotReady and taints it, and vip follows the Node: its VIPs
    // move and it leaves every ring while NotReady, and comes back when Ready.
    let victim = vc::holder(&c, vip, 30 * SECOND).unwrap();
    let v = c.nodes().iter().position(|x| x.name == victim).unwrap();
    let pod_nodes = vc::pod_nodes(&c, "web").unwrap();
    let load = Load::start(c.client(), vip, 12).unwrap();
    std::thread::sleep(SECOND);
    let fault_at = load.elapsed();
    assert!(c.node(v).stop_kubelet(), "{victim}: the kubelet was running");
    let not_ready = c.wait_node_ready_status(&victim, "Unknown", Duration::from_secs(90)).unwrap();
    let others: Vec<usize> = (0..n).filter(|i| *i != v).collect();
    let left = vc::poll("the NotReady node's VIP moved and the node out of the ring", 30 * SECOND, || {
        Ok(others
            .iter()
            .all(|i| {
                vc::status(&c, *i)
                    .is_ok_and(|s| s.owners.get(&vip).is_some_and(|o| *o != victim) && s.services.iter().any(|x| x.vip == vip && !x.backends.contains(&victim)))
            })
            .then_some(()))
    });
    std::thread::sleep(2 * SECOND);
    let r = load.finish().unwrap();
    eprintln!("cluster-vip: kubelet of {victim} stopped: NotReady (Unknown) after {not_ready:?}; {} of {} new connections failed; {r:?}", r.failed, r.attempts);
    left.unwrap();
    // The node leaves the rings while its pods still run: connections its pods serve
    // break when the VIP moves (the new holder never saw them), a handshake under way
    // at that instant among them. No other new connection may fail.
    let (first, last) = (r.broken_at.iter().min().copied(), r.broken_at.iter().max().copied());
    let at_the_move = |t: &Duration| first.zip(last).is_some_and(|(f, l)| *t + SECOND >= f && *t <= l + SECOND);
    assert!(
        r.failed_at.iter().all(at_the_move) && r.failed <= 3,
        "kubelet stopped: the VIP moved between two live agents, no new connection may fail but those to the leaving node's pods at the move: {r:?}\n{}",
        vc::agent_logs(&c)
    );
    let f = vc::FaultReport { victim: victim.clone(), fault_at, new_holder: None, load: r, pod_nodes };
    f.survivors_kept(&c, "kubelet stopped").unwrap();
    c.node(v).start_kubelet().unwrap();
    let back = c.wait_node_ready_status(&victim, "True", Duration::from_secs(90)).unwrap();
    vc::poll("the node back in the ring after its kubelet returned", 30 * SECOND, || {
        Ok((0..n).all(|i| vc::status(&c, i).is_ok_and(|s| s.services.iter().any(|x| x.vip == vip && x.backends.contains(&victim)))).then_some(()))
    })
    .unwrap();
    eprintln!("cluster-vip: kubelet of {victim} back: Ready after {back:?}, the VIP held by {}", vc::holder(&c, vip, 30 * SECOND).unwrap());

    // 5. Upgrades under load.
    for (what, upgrade) in [("rollout restart", vc::Upgrade::RolloutRestart), ("image change", vc::Upgrade::next_image())] {
        let r = vc::upgrade_under_load(&c, vip, &upgrade).unwrap();
        eprintln!(
            "cluster-vip: upgrade ({what}): {} of {} new connections failed, {} of {} long-lived broke; {r:?}",
            r.failed,
            r.attempts,
            r.broken_total(),
            r.long_lived.values().sum::<u32>()
        );
        assert_eq!((r.failed, r.broken_total()), (0, 0), "{what}: failed new connections and broken long-lived ones: {r:?}\n{}", vc::agent_logs(&c));
    }

    // No node's stack routed a VIP's frame back to the holder: the holder would
    // balance it again, maybe to the same node, until its TTL ran out, and that
    // node's conntrack would keep the 5-tuple without NAT for minutes (a SYN that
    // arrives before kube-proxy there has the new address, route_guard).
    let routed = c.segment().routed_count().unwrap();
    assert_eq!(routed, 0, "frames to the pool's addresses routed by a node ({routed}), not sent by the client");

    // kubeadm's (and kind's) control-plane marks put on the holder's Node (its
    // label and taint as `kubeadm init` sets them): the VIP moves off it, and a
    // rolling restart completes (`rollout status` returns) with the agent there
    // Ready as idle; the marks removed, the node is a backend again.
    const CP: &str = vip_tests::kubelab::CONTROL_PLANE_LABEL;
    const EXCLUDE: &str = vip_agent::k8s::source::EXCLUDE_FROM_LB_LABEL;
    let marked = vc::holder(&c, vip, 30 * SECOND).unwrap();
    c.kubectl(&["label", "node", &marked, &format!("{CP}="), &format!("{EXCLUDE}=")]).unwrap();
    c.kubectl(&["taint", "node", &marked, &format!("{CP}:NoSchedule")]).unwrap();
    let moved =
        vc::poll("the VIP off the node marked as a kubeadm control plane", 30 * SECOND, || Ok(vc::holder(&c, vip, SECOND).ok().filter(|h| *h != marked)));
    moved.unwrap_or_else(|e| panic!("{e:#}\n{}", vc::agent_logs(&c)));
    c.kubectl(&["-n", "vip-system", "rollout", "restart", "daemonset/vip-agent"]).unwrap();
    c.wait_rollout("daemonset/vip-agent", "vip-system", Duration::from_secs(180)).unwrap();
    eprintln!("cluster-vip: {marked} marked as kubeadm's control plane: the VIP moved off it and a rolling restart completed");
    c.kubectl(&["label", "node", &marked, &format!("{CP}-"), &format!("{EXCLUDE}-")]).unwrap();
    c.kubectl(&["taint", "node", &marked, &format!("{CP}:NoSchedule-")]).unwrap();
    vc::poll("the unmarked node back in the ring", 30 * SECOND, || {
        Ok((0..n).all(|i| vc::status(&c, i).is_ok_and(|s| s.services.iter().any(|x| x.vip == vip && x.backends.contains(&marked)))).then_some(()))
    })
    .unwrap_or_else(|e| panic!("{e:#}\n{}", vc::agent_logs(&c)));

    // 6. Uninstall.
    c.kubectl(&["delete", "-k", deploy_dir().to_str().unwrap(), "--wait=true", "--timeout=120s"]).unwrap();
    c.apply_kustomize(&deploy_dir().join("cleanup")).unwrap();
    c.wait_rollout("daemonset/vip-cleanup", "vip-cleanup", Duration::from_secs(120)).unwrap();
    c.kubectl(&["delete", "-k", deploy_dir().join("cleanup").to_str().unwrap(), "--wait=true", "--timeout=120s"]).unwrap();
    for node in c.nodes() {
        let link = stdout(&node.exec(&["ip", "-d", "link", "show", "eth0"]).unwrap());
        assert!(!link.contains("prog/xdp"), "{}: XDP still attached after the clean-up: {link}", node.name);
        let bpffs = stdout(&node.exec(&["ls", "-A", "/sys/fs/bpf"]).unwrap());
        assert!(!bpffs.split_whitespace().any(|x| x == "vip"), "{}: pins left: {bpffs}", node.name);
        let rules = stdout(&node.exec(&["ip", "rule", "show"]).unwrap()) + &stdout(&node.exec(&["ip", "route", "show", "table", "all"]).unwrap());
        assert!(!rules.contains("7473"), "{}: route_guard's rule or routes left: {rules}", node.name);
    }

    // 7. Teardown: nothing of the harness is left on the machine.
    let footprint = c.footprint().clone();
    let t = std::time::Instant::now();
    drop(c);
    eprintln!("teardown: {:.1} s", t.elapsed().as_secs_f64());
    let left = footprint.leftovers();
    assert!(left.is_empty(), "left after teardown: {left:#?}");
}
