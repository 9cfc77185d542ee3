//! vip installed on a real cluster of each address family the README names
//! (`vip_tests::cluster` with [`ClusterSpec::stack`]): an IPv6-only cluster and
//! a dual-stack one (IPv4 primary). As a user installs it, with `kubectl apply -k
//! deploy/` and the example pool's addresses replaced by the segment's:
//!
//! - every agent pod Ready (`rollout status` returns): the kubelet probes the
//!   agent on the node's primary InternalIP, which is IPv6 in the IPv6-only
//!   cluster, where no node has an IPv4 address;
//! - a LoadBalancer Service (IPv6-only: the cluster's one family; dual-stack:
//!   `ipFamilyPolicy: RequireDualStack`) gets one address per family from the
//!   pool, each answered by its holder (ARP or NDP) and spread over both nodes'
//!   pods;
//! - each address moves when its holder's agent is SIGKILLed under load, new
//!   connections resume, and long-lived ones served by the other node survive.
//!
//! The IPv4 cluster and everything else a user does with it are in
//! cluster_vip.rs; these runs bring up a cluster of their own each (about a
//! minute) and need the same binaries.
use std::{net::IpAddr, time::Duration};

use serde_json::Value;
use vip_tests::{
    apiserver::Stack,
    cluster::{self, Cluster, ClusterSpec},
    vipcluster as vc,
};

const SECOND: Duration = Duration::from_secs(1);

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The cluster of `stack`, vip installed, the pool applied and Service `web`
/// (Cluster policy, a pod on each node, `extra_spec` in its spec) given one
/// address per family: the cluster and the addresses, in ingress order.
fn installed(stack: Stack, extra_spec: &str) -> Option<(Cluster, Vec<IpAddr>)> {
    let spec = ClusterSpec { stack, ..Default::default() };
    if !cluster::available(&spec) {
        return None;
    }
    let c = Cluster::start(spec).expect("the cluster");
    // The Nodes registered with the addresses of the cluster's families, primary first.
    for (i, node) in c.nodes().iter().enumerate() {
        let n = c.get(&format!("/api/v1/nodes/{}", node.name)).unwrap();
        let internal: Vec<IpAddr> = n["status"]["addresses"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["type"] == "InternalIP")
            .filter_map(|a| a["address"].as_str()?.parse().ok())
            .collect();
        assert_eq!(internal, cluster::node_addrs(stack, i), "{}: its InternalIPs", node.name);
        let cidrs: Vec<&str> = n["spec"]["podCIDRs"].as_array().unwrap().iter().filter_map(Value::as_str).collect();
        assert_eq!(cidrs.iter().map(|c| c.contains(':')).collect::<Vec<_>>(), stack.pick(false, true), "{}: a pod range per family: {cidrs:?}", node.name);
    }
    let took = vc::install(&c).unwrap_or_else(|e| panic!("{e:#}\n{}", c.diagnose()));
    eprintln!("cluster-shapes ({}): every agent pod Ready {:.1} s after kubectl apply -k deploy/", stack.families().join(" + "), took.as_secs_f64());
    vc::apply_pool(&c).unwrap();
    let n = c.nodes().len();
    vc::apply_web_with(&c, "web", n, "Cluster", None, extra_spec).unwrap();
    let families = stack.families().len();
    let vips = vc::wait_vips(&c, "web", families, 30 * SECOND).unwrap();
    let svc = c.get("/api/v1/namespaces/default/services/web").unwrap();
    assert_eq!(svc["spec"]["ipFamilies"], serde_json::json!(stack.families()), "the Service's families");
    assert_eq!(vips.iter().map(IpAddr::is_ipv6).collect::<Vec<_>>(), stack.pick(false, true), "one address per family, in the Service's order: {vips:?}");
    Some((c, vips))
}

/// `vip` answered by its holder and spread over every node's pod; then its
/// holder's agent SIGKILLed under load: the address moves, and connections
/// served by the other node survive.
fn serves_and_fails_over(c: &Cluster, vip: IpAddr) {
    let n = c.nodes().len();
    let holder = vc::holder(c, vip, 30 * SECOND).unwrap();
    vc::poll(&format!("every pod answering through {vip}"), 20 * SECOND, || Ok(vc::spread(c, vip, 10).ok().filter(|s| s.len() == n))).unwrap();
    let seen = vc::spread(c, vip, 40).unwrap_or_else(|e| panic!("{vip}: {e:#}\n{}", c.diagnose()));
    eprintln!("cluster-shapes: 40 connections to {vip} (held by {holder}) answered by {seen:?}");
    assert_eq!(seen.len(), n, "{vip}: every node's pod answers: {seen:?}");
    let f = vc::kill_agent_trial(c, "web", vip).unwrap();
    eprintln!("cluster-shapes: {vip}: agent pod SIGKILL on {}, then {:?} held it: {:?}", f.victim, f.new_holder, f.load);
    assert!(f.new_holder.as_ref().is_some_and(|h| *h != f.victim), "{vip}: the address moved off {}: {:?}", f.victim, f.new_holder);
    f.survivors_kept(c, &format!("{vip}: agent pod killed")).unwrap();
    assert!(f.load.longest_gap < 5 * SECOND, "{vip}: new connections stopped for {:?}", f.load.longest_gap);
    let after = vc::spread(c, vip, 20).unwrap_or_else(|e| panic!("{vip} after the failover: {e:#}\n{}", vc::agent_logs(c)));
    assert_eq!(after.values().sum::<usize>(), 20);
}

#[test]
#[cfg_attr(not(real_cluster), ignore = "needs KUBEBUILDER_ASSETS and VIP_KUBE_NODE_ASSETS (a Kubernetes release's binaries; docs/development/tests.md)")]
fn ipv6_only_cluster_rolls_out_answers_spreads_and_fails_over() {
    let Some((c, vips)) = installed(Stack::V6, "") else { return };
    for node in c.nodes() {
        let v4 = stdout(&node.exec(&["ip", "-4", "-o", "addr", "show", "dev", "eth0"]).unwrap());
        assert!(v4.trim().is_empty(), "{}: an IPv6-only node has no IPv4 address: {v4}", node.name);
    }
    serves_and_fails_over(&c, vips[0]);
}

#[test]
#[cfg_attr(not(real_cluster), ignore = "needs KUBEBUILDER_ASSETS and VIP_KUBE_NODE_ASSETS (a Kubernetes release's binaries; docs/development/tests.md)")]
fn dual_stack_cluster_gives_both_families_each_answered_spread_and_moved() {
    let Some((c, vips)) = installed(Stack::Dual, "  ipFamilyPolicy: RequireDualStack\n") else { return };
    for vip in vips {
        serves_and_fails_over(&c, vip);
    }
}
