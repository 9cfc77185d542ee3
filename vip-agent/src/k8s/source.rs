//! The Kubernetes source: the same model the YAML file fills, built from Nodes,
//! VipPools, Services and EndpointSlices. Pure (`world_from`); the watching side
//! feeds it the reflectors' current objects.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use k8s_openapi::api::{
    core::v1::{Node as KNode, Service as KService},
    discovery::v1::EndpointSlice,
};
use kube::ResourceExt;

use super::{
    allocate::{self, key},
    crd::VipPool,
    pools::check_pools,
};
use crate::{
    addrs::Family,
    model::{self, HealthCheck, Probe, Protocol, World},
};

/// The label EndpointSlices carry with their Service's name.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// The label with which cloud controllers leave a node out of every load
/// balancer (`node.kubernetes.io/exclude-from-external-load-balancers`, any value).
/// Such a node neither holds VIPs nor is a backend.
pub const EXCLUDE_FROM_LB_LABEL: &str = "node.kubernetes.io/exclude-from-external-load-balancers";

/// Taints the node lifecycle controller keeps on a node while the control plane
/// does not consider it ready (admission puts `not-ready:NoSchedule` on every new
/// Node; the controller lifts it once it has seen `Ready=True`).
const NOT_READY_TAINTS: [&str; 3] = ["node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable", "node.kubernetes.io/network-unavailable"];

/// The taint of a cordoned node (`kubectl cordon`: `spec.unschedulable: true`).
pub const UNSCHEDULABLE_TAINT: &str = "node.kubernetes.io/unschedulable";

/// kube-proxy's health server on every node (`--healthz-bind-address`, default
/// `0.0.0.0:10256`): `/healthz` answers 200 while its rules are in sync and the
/// node is not being deleted (KEP-3458), which is what cloud load balancers probe
/// for `externalTrafficPolicy: Cluster`.
pub const KUBE_PROXY_HEALTHZ_PORT: u16 = 10256;

/// A Node as the model sees it; why it is left out when it is not ready or excluded.
///
/// Ready means the `Ready` condition is `True`, `NetworkUnavailable` is not `True`
/// (the CNI has not set up its routes: nothing reaches pods from there), and none
/// of the node controller's not-ready taints is left. A Ready node still carrying
/// `node.kubernetes.io/not-ready` (a new node for up to a node-monitor period, or
/// one whose `Ready` flaps) is deliberately left out until the controller lifts the
/// taint: the control plane, kube-proxy and the scheduler do not yet count it
/// either, and the taint gives the flapping node a hysteresis. Pool tolerations do
/// not change this: they are about which ready nodes may hold VIPs.
///
/// A cordon is not a reason to move VIPs: see `UNSCHEDULABLE_TAINT` in `world_from`.
fn node_from(n: &KNode) -> Result<model::Node, String> {
    if n.labels().contains_key(EXCLUDE_FROM_LB_LABEL) {
        return Err(format!("labelled {EXCLUDE_FROM_LB_LABEL}"));
    }
    let Some(status) = n.status.as_ref() else { return Err("no status yet".into()) };
    let condition = |t: &str| status.conditions.iter().flatten().find(|c| c.type_ == t).map(|c| c.status.as_str());
    if condition("Ready") != Some("True") {
        return Err("not Ready".into());
    }
    if condition("NetworkUnavailable") == Some("True") {
        return Err("NetworkUnavailable".into());
    }
    let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref()).into_iter().flatten();
    if let Some(t) = taints.clone().find(|t| NOT_READY_TAINTS.contains(&t.key.as_str())) {
        return Err(format!("tainted {}", t.key));
    }
    // The first InternalIP, of either family: kubelet lists the primary family first.
    let Some(addr) = status.addresses.iter().flatten().find(|a| a.type_ == "InternalIP").and_then(|a| a.address.parse::<IpAddr>().ok()) else {
        return Err("no InternalIP".into());
    };
    if let Some(why) = crate::spec::node_address_problem(addr) {
        return Err(format!("InternalIP {addr} {why}"));
    }
    let taints = taints
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .map(|t| model::Taint { key: t.key.clone(), value: t.value.clone().unwrap_or_default(), effect: t.effect.clone() })
        .collect();
    Ok(model::Node { name: n.name_any(), addr, mac: None, labels: n.labels().clone(), taints })
}

/// Nodes with a ready endpoint of `svc` of `family` (for `externalTrafficPolicy:
/// Local`): a dual-stack Service has a slice per family, and a node that has its
/// IPv6 endpoints ready but not its IPv4 ones does not serve its IPv4 VIP locally.
fn local_endpoint_nodes(svc: &KService, slices: &[EndpointSlice], family: Family) -> BTreeSet<String> {
    let ns = svc.namespace();
    slices
        .iter()
        .filter(|s| s.namespace() == ns && s.labels().get(SERVICE_NAME_LABEL) == Some(&svc.name_any()))
        .filter(|s| s.address_type == family.name())
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .filter_map(|e| e.node_name.clone())
        .collect()
}

/// Watches Nodes, VipPools, Services and EndpointSlices and publishes the model
/// built from them (after the first complete view, then on every change, bursts
/// coalesced). `base` as for `world_from`. Fails when a watch has not listed
/// within `sync_timeout`, naming it.
pub async fn watch_world(client: kube::Client, base: World, sync_timeout: Duration) -> anyhow::Result<tokio::sync::watch::Receiver<World>> {
    use kube::Api;
    let (tx, mut changed) = tokio::sync::mpsc::unbounded_channel();
    let nodes = super::reflect(Api::<KNode>::all(client.clone()), tx.clone());
    let pools = super::reflect(Api::<VipPool>::all(client.clone()), tx.clone());
    let services = super::reflect(Api::<KService>::all(client.clone()), tx.clone());
    let slices = super::reflect(Api::<EndpointSlice>::all(client), tx);
    let waits = vec![listed("nodes", &nodes), listed("vippools", &pools), listed("services", &services), listed("endpointslices", &slices)];
    let every = (sync_timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(10));
    if let Err(missing) = first_lists(waits, sync_timeout, every).await {
        let errors = missing.iter().map(|m| (*m, super::api_health().last_error(&super::watch_name(m)))).collect::<Vec<_>>();
        anyhow::bail!("{}", sync_timeout_message(&errors, sync_timeout));
    }
    let build =
        move || world_from(&super::owned(nodes.state()), &super::owned(pools.state()), &super::owned(services.state()), &super::owned(slices.state()), &base);
    let (out, rx) = tokio::sync::watch::channel(build());
    tokio::spawn(async move {
        while changed.recv().await.is_some() {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            while changed.try_recv().is_ok() {}
            let w = build();
            out.send_if_modified(|cur| std::mem::replace(cur, w.clone()) != w);
            if out.is_closed() {
                return;
            }
        }
    });
    Ok(rx)
}

/// A watch's name and the future of its first complete list.
type FirstList = (&'static str, futures::future::BoxFuture<'static, ()>);

fn listed<K: kube::Resource + Clone + Send + Sync + 'static>(name: &'static str, store: &kube::runtime::reflector::Store<K>) -> FirstList
where
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let store = store.clone();
    (
        name,
        Box::pin(async move {
            // Err: the writer is gone (the watch task ended); nothing more will come.
            let _ = store.wait_until_ready().await;
        }),
    )
}

/// Waits for every first list, logging which are done and which pending every
/// `every`; after `timeout`, the names of those still pending.
async fn first_lists(waits: Vec<FirstList>, timeout: Duration, every: Duration) -> Result<(), Vec<&'static str>> {
    use futures::StreamExt;
    let start = tokio::time::Instant::now();
    let mut pending: Vec<&'static str> = waits.iter().map(|(n, _)| *n).collect();
    let mut done: Vec<&'static str> = Vec::new();
    let mut lists: futures::stream::FuturesUnordered<_> = waits
        .into_iter()
        .map(|(n, f)| async move {
            f.await;
            n
        })
        .collect();
    let mut progress = tokio::time::interval_at(start + every, every);
    let deadline = tokio::time::sleep_until(start + timeout);
    tokio::pin!(deadline);
    while !pending.is_empty() {
        tokio::select! {
            Some(n) = lists.next() => {
                pending.retain(|p| *p != n);
                done.push(n);
            }
            _ = progress.tick() => tracing::info!("{}", progress_line(&done, &pending, start.elapsed(), timeout)),
            _ = &mut deadline => return Err(pending),
        }
    }
    tracing::info!("first lists of {} received in {:.1} s", done.join(", "), start.elapsed().as_secs_f64());
    Ok(())
}

/// The line logged while the start waits for its first lists.
fn progress_line(done: &[&str], pending: &[&str], elapsed: Duration, timeout: Duration) -> String {
    let done = if done.is_empty() { "none yet".to_owned() } else { done.join(", ") };
    format!(
        "waiting for the first list of {} from the Kubernetes API (done: {done}); {} s of {} s (--sync-timeout)",
        pending.join(", "),
        elapsed.as_secs(),
        timeout.as_secs()
    )
}

/// Why the start gave up, for the operator installing vip: the watches that never
/// listed, their last errors, and the usual causes.
fn sync_timeout_message(missing: &[(&str, Option<String>)], timeout: Duration) -> String {
    let what: Vec<String> = missing
        .iter()
        .map(|(m, e)| match e {
            Some(e) => format!("{m} (last error: {e})"),
            None => format!("{m} (no error seen: the API server did not answer the list)"),
        })
        .collect();
    let mut hints = Vec::new();
    if missing.iter().any(|(m, _)| *m == "vippools") {
        hints.push("the VipPool CRD may not be installed (`kubectl get crd vippools.vip.dev`; apply deploy/crd.yaml)".to_owned());
    }
    hints.push(
        "the agent's ServiceAccount may lack RBAC to list and watch them (deploy/10-rbac.yaml; \
         `kubectl auth can-i watch <resource> --as system:serviceaccount:vip-system:vip-agent`)"
            .to_owned(),
    );
    format!(
        "the Kubernetes start gave up after {} s (--sync-timeout / VIP_SYNC_TIMEOUT): no first list of {}. Likely: {}",
        timeout.as_secs_f64(),
        what.join("; "),
        hints.join("; or ")
    )
}

/// Builds the model. `base` carries the settings the cluster objects do not
/// (announce and failover timers, Maglev seed); its nodes, pools and services are replaced.
pub fn world_from(nodes: &[KNode], pools: &[VipPool], services: &[KService], slices: &[EndpointSlice], base: &World) -> World {
    let mut w = World { nodes: Vec::new(), left_out: BTreeMap::new(), ..base.clone() };
    for n in nodes {
        match node_from(n) {
            Ok(node) => w.nodes.push(node),
            Err(why) => {
                w.left_out.insert(n.name_any(), why);
            }
        }
    }
    w.nodes.sort_by(|a, b| a.name.cmp(&b.name));
    w.pools.clear();
    w.services.clear();
    let mut valid = Vec::new();
    for c in check_pools(pools) {
        let (Some(v), Some(p)) = (c.valid, pools.iter().find(|p| p.name_any() == c.name)) else { continue };
        let tolerations = p
            .spec
            .tolerations
            .iter()
            .map(|t| model::Toleration {
                key: t.key.clone().unwrap_or_default(),
                exists: t.operator.as_deref() == Some("Exists"),
                value: t.value.clone().unwrap_or_default(),
                effect: t.effect.clone().unwrap_or_default(),
            })
            .collect::<Vec<_>>();
        // A cordon (`kubectl cordon`/`drain`: `spec.unschedulable` and the
        // `node.kubernetes.io/unschedulable:NoSchedule` taint) is about new pods.
        // The node keeps forwarding through kube-proxy and stays a backend, so it
        // keeps its VIPs too, as cloud load balancers keep cordoned nodes since
        // Kubernetes 1.19 (kubernetes/kubernetes#90823). MetalLB went back and forth:
        // metallb/metallb#2470 stopped announcing from cordoned nodes, which cut
        // traffic for users who cordon without draining (or tolerate the taint),
        // and metallb/metallb#2715 reverts it. Every pool tolerates the taint; a
        // pool setting that makes cordoned nodes ineligible to hold VIPs would only
        // leave this toleration out (cordoned nodes would still be backends).
        let tolerations = tolerations
            .into_iter()
            .chain([model::Toleration { key: UNSCHEDULABLE_TAINT.into(), exists: true, value: String::new(), effect: String::new() }])
            .collect();
        w.pools.push(model::Pool {
            name: c.name.clone(),
            // Filled below with the pool's addresses in use.
            addresses: Vec::new(),
            node_selector: p.spec.node_selector.clone(),
            tolerations,
            announce: v.announce,
            garp: v.garp,
            interfaces: v.interfaces.clone(),
            vlan: v.vlan,
        });
        valid.push((p, v));
    }
    for svc in services {
        let spec = svc.spec.clone().unwrap_or_default();
        let mut vips: Vec<IpAddr> = Vec::new();
        if allocate::is_ours(svc) {
            vips.extend(
                svc.status
                    .iter()
                    .flat_map(|s| s.load_balancer.iter())
                    .flat_map(|lb| lb.ingress.iter().flatten())
                    .filter_map(|i| i.ip.as_deref()?.parse::<IpAddr>().ok()),
            );
        }
        vips.extend(spec.external_ips.iter().flatten().filter_map(|a| a.parse::<IpAddr>().ok()));
        // A dual-stack Service is two services of the model, one per family.
        let dual = vips.iter().any(|v| v.is_ipv4()) && vips.iter().any(|v| v.is_ipv6());
        let local = spec.external_traffic_policy.as_deref() == Some("Local");
        for vip in vips {
            let Some((pool, v)) = valid.iter().find(|(_, v)| v.addresses.contains(vip)) else { continue };
            let mut by_proto: BTreeMap<Protocol, Vec<u16>> = BTreeMap::new();
            for p in spec.ports.iter().flatten() {
                let proto = match p.protocol.as_deref().unwrap_or("TCP") {
                    "TCP" => Protocol::Tcp,
                    "UDP" => Protocol::Udp,
                    _ => continue,
                };
                by_proto.entry(proto).or_default().push(p.port as u16);
            }
            for (protocol, ports) in by_proto {
                let health = match (local, spec.health_check_node_port) {
                    // kube-proxy answers 200 on this port only where the Service has local endpoints.
                    (true, Some(port)) => Some(HealthCheck {
                        probe: Probe::Http { port: port as u16, path: "/healthz".into() },
                        interval: v.health.as_ref().map_or(Duration::from_secs(2), |h| h.interval),
                        timeout: v.health.as_ref().map_or(Duration::from_secs(1), |h| h.timeout),
                        rise: v.health.as_ref().map_or(2, |h| h.rise),
                        fall: v.health.as_ref().map_or(2, |h| h.fall),
                    }),
                    // A pool's check that names a port probes that port. A bare `type:
                    // http` (no port, no path) probes kube-proxy's health server on the
                    // node at `/healthz`, as cloud load balancers do: with kube-proxy
                    // nothing listens on NodeIP:<service port>. Any other check without
                    // a port (`type: tcp`, or http with a path) probes the Service's first
                    // port, for data paths where something listens there (hostNetwork
                    // backends, no kube-proxy).
                    _ => v.health.clone().map(|mut h| {
                        if let Some(c) = pool.spec.health_check.as_ref().filter(|c| c.port.is_none()) {
                            h.probe = match h.probe {
                                Probe::Tcp { .. } => Probe::Tcp { port: ports[0] },
                                Probe::Http { .. } if c.path.is_none() => Probe::Http { port: KUBE_PROXY_HEALTHZ_PORT, path: "/healthz".into() },
                                Probe::Http { path, .. } => Probe::Http { port: ports[0], path },
                            };
                        }
                        h
                    }),
                };
                let mut name = if spec.ports.iter().flatten().any(|p| p.protocol.as_deref() == Some("UDP")) && protocol == Protocol::Udp {
                    format!("{}/udp", key(svc))
                } else {
                    key(svc)
                };
                if dual && vip.is_ipv6() {
                    name.push_str("/ipv6");
                }
                let family = if vip.is_ipv4() { Family::V4 } else { Family::V6 };
                w.services.push(model::Service {
                    name,
                    vip,
                    ports,
                    protocol,
                    table_size: v.table_size,
                    backend_selector: pool.spec.node_selector.clone(),
                    backend_nodes: local.then(|| local_endpoint_nodes(svc, slices, family)),
                    health,
                    no_healthy_backend: pool.spec.no_healthy_backend,
                });
            }
        }
    }
    // Only addresses in use are held and answered: a free address of a pool may be
    // used by something else on the segment until it is allocated, and answering
    // ARP for it would draw that traffic (the file source, where the operator lists
    // each VIP on purpose, holds every address of its pools).
    let in_use: std::collections::BTreeSet<IpAddr> = w.services.iter().map(|s| s.vip).collect();
    for (p, (_, v)) in w.pools.iter_mut().zip(&valid) {
        p.addresses = in_use.iter().copied().filter(|a| v.addresses.contains(*a)).collect();
    }
    w
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::{
            core::v1::{
                LoadBalancerIngress, LoadBalancerStatus, NodeAddress, NodeCondition, NodeSpec, NodeStatus, ServicePort, ServiceSpec, ServiceStatus, Taint,
            },
            discovery::v1::{Endpoint, EndpointConditions},
        },
        apimachinery::pkg::apis::meta::v1::ObjectMeta,
    };

    use super::*;

    fn knode(name: &str, ip: &str, ready: bool, labels: &[(&str, &str)], taint: Option<&str>) -> KNode {
        KNode {
            metadata: ObjectMeta {
                name: Some(name.into()),
                labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                taints: taint.map(|k| vec![Taint { key: k.into(), effect: "NoSchedule".into(), ..Default::default() }]),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                addresses: Some(vec![NodeAddress { type_: "InternalIP".into(), address: ip.into() }]),
                conditions: Some(vec![NodeCondition { type_: "Ready".into(), status: if ready { "True" } else { "False" }.into(), ..Default::default() }]),
                ..Default::default()
            }),
        }
    }

    fn kpool(name: &str, yaml: &str) -> VipPool {
        VipPool::new(name, serde_yaml_ng::from_str(yaml).unwrap())
    }

    fn ksvc(name: &str, ip: Option<&str>, local: bool, ports: &[(&str, i32)]) -> KService {
        KService {
            metadata: ObjectMeta { name: Some(name.into()), namespace: Some("shop".into()), ..Default::default() },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                external_traffic_policy: Some(if local { "Local" } else { "Cluster" }.into()),
                health_check_node_port: local.then_some(32000),
                ports: Some(ports.iter().map(|(p, n)| ServicePort { port: *n, protocol: Some(p.to_string()), ..Default::default() }).collect()),
                ..Default::default()
            }),
            status: ip.map(|ip| ServiceStatus {
                load_balancer: Some(LoadBalancerStatus { ingress: Some(vec![LoadBalancerIngress { ip: Some(ip.into()), ..Default::default() }]) }),
                ..Default::default()
            }),
        }
    }

    fn slice(svc: &str, eps: &[(&str, bool)]) -> EndpointSlice {
        EndpointSlice {
            metadata: ObjectMeta {
                name: Some(format!("{svc}-x")),
                namespace: Some("shop".into()),
                labels: Some([(SERVICE_NAME_LABEL.to_owned(), svc.to_owned())].into()),
                ..Default::default()
            },
            address_type: "IPv4".into(),
            endpoints: eps
                .iter()
                .map(|(n, r)| Endpoint {
                    addresses: vec!["10.0.0.1".into()],
                    node_name: Some(n.to_string()),
                    conditions: Some(EndpointConditions { ready: Some(*r), ..Default::default() }),
                    ..Default::default()
                })
                .collect(),
            ports: None,
        }
    }

    #[tokio::test]
    async fn the_start_names_the_watches_that_never_listed() {
        // Lists that arrive after `ms` (None: never), against a timeout far longer than those.
        let after = |name: &'static str, ms: Option<u64>| -> FirstList {
            (
                name,
                Box::pin(async move {
                    match ms {
                        Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
                        None => std::future::pending().await,
                    }
                }),
            )
        };
        let waits = vec![after("nodes", Some(0)), after("vippools", None), after("services", Some(30)), after("endpointslices", None)];
        assert_eq!(first_lists(waits, Duration::from_secs(1), Duration::from_millis(300)).await, Err(vec!["vippools", "endpointslices"]));
        let waits = vec![after("nodes", Some(10)), after("vippools", Some(50))];
        assert_eq!(first_lists(waits, Duration::from_secs(30), Duration::from_secs(10)).await, Ok(()));

        let line = progress_line(&["nodes"], &["vippools", "services"], Duration::from_secs(5), Duration::from_secs(60));
        assert_eq!(line, "waiting for the first list of vippools, services from the Kubernetes API (done: nodes); 5 s of 60 s (--sync-timeout)");
        let m =
            sync_timeout_message(&[("vippools", Some("the server could not find the requested resource".into())), ("services", None)], Duration::from_secs(60));
        assert!(m.starts_with("the Kubernetes start gave up after 60 s (--sync-timeout / VIP_SYNC_TIMEOUT): no first list of vippools (last error: the server could not find the requested resource); services (no error seen"), "{m}");
        assert!(m.contains("VipPool CRD may not be installed") && m.contains("deploy/10-rbac.yaml"), "{m}");
        assert!(!sync_timeout_message(&[("services", None)], Duration::from_secs(60)).contains("CRD"), "the CRD hint only when VipPools are missing");
    }

    #[test]
    fn cluster_objects_become_the_model() {
        let nodes = [
            knode("n1", "198.18.0.11", true, &[("vip", "yes")], None),
            knode("n2", "198.18.0.12", true, &[("vip", "yes")], Some("dedicated")),
            knode("n3", "198.18.0.13", false, &[("vip", "yes")], None),
            knode("n4", "198.18.0.14", true, &[], None),
        ];
        let pools = [kpool("p", "addresses: [198.18.1.10-198.18.1.20]\nnodeSelector: {vip: \"yes\"}\ntableSize: 251\nhealthCheck: {type: tcp}\n")];
        let svcs = [
            ksvc("web", Some("198.18.1.10"), false, &[("TCP", 80), ("TCP", 443), ("UDP", 443)]),
            ksvc("local", Some("198.18.1.11"), true, &[("TCP", 8080)]),
            ksvc("pending", None, false, &[("TCP", 80)]),
            ksvc("outside", Some("203.0.113.1"), false, &[("TCP", 80)]),
        ];
        let slices = [slice("local", &[("n1", true), ("n2", false), ("n4", true)])];
        let w = world_from(&nodes, &pools, &svcs, &slices, &World::default());
        assert_eq!(w.nodes.iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1", "n2", "n4"], "not-ready n3 left out");
        assert_eq!(w.eligible(&w.pools[0]).iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1"], "n2 tainted, n4 unlabelled");
        let names: Vec<(&str, Protocol, Vec<u16>)> = w.services.iter().map(|s| (s.name.as_str(), s.protocol, s.ports.clone())).collect();
        assert_eq!(names, [("shop/web", Protocol::Tcp, vec![80, 443]), ("shop/web/udp", Protocol::Udp, vec![443]), ("shop/local", Protocol::Tcp, vec![8080])]);
        let web = &w.services[0];
        assert_eq!((web.table_size, web.health.as_ref().unwrap().probe.clone()), (251, Probe::Tcp { port: 80 }));
        let local = &w.services[2];
        assert_eq!(local.backend_nodes, Some(["n1".to_owned(), "n4".to_owned()].into()), "ready endpoints only");
        assert_eq!(w.backend_candidates(local).iter().map(|n| n.name.as_str()).collect::<Vec<_>>(), ["n1"], "and only eligible nodes");
        assert_eq!(local.health.as_ref().unwrap().probe, Probe::Http { port: 32000, path: "/healthz".into() });
        // Only the pool's addresses in use are held (answered by ARP), not the 11 of its range.
        let used: Vec<IpAddr> = w.services.iter().map(|s| s.vip).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        assert_eq!(w.pools[0].addresses, used);
        assert!(used.len() < 11);
    }

    #[test]
    fn tolerated_taints_keep_nodes_eligible() {
        let nodes = [knode("n2", "198.18.0.12", true, &[], Some("dedicated"))];
        let pools = [kpool("p", "addresses: [198.18.1.10]\ntolerations: [{key: dedicated, operator: Exists}]\n")];
        let w = world_from(&nodes, &pools, &[], &[], &World::default());
        assert_eq!(w.eligible(&w.pools[0]).len(), 1);
    }

    /// A Node as the API server returns it for a kubeadm cluster: kubelet labels,
    /// `Ready` and the other conditions, addresses, and `extra` merged into it.
    fn api_node(name: &str, ip: &str, extra: serde_json::Value) -> KNode {
        let mut v = serde_json::json!({
            "apiVersion": "v1", "kind": "Node",
            "metadata": { "name": name, "labels": {
                "kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
                "beta.kubernetes.io/os": "linux", "beta.kubernetes.io/arch": "amd64" } },
            "spec": { "podCIDR": "10.244.1.0/24", "podCIDRs": ["10.244.1.0/24"] },
            "status": {
                "addresses": [{ "type": "InternalIP", "address": ip }, { "type": "Hostname", "address": name }],
                "conditions": [
                    { "type": "NetworkUnavailable", "status": "False", "reason": "CalicoIsUp", "message": "Calico is running on this node" },
                    { "type": "MemoryPressure", "status": "False", "reason": "KubeletHasSufficientMemory" },
                    { "type": "DiskPressure", "status": "False", "reason": "KubeletHasNoDiskPressure" },
                    { "type": "PIDPressure", "status": "False", "reason": "KubeletHasSufficientPID" },
                    { "type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status" }
                ]
            }
        });
        merge(&mut v, extra);
        serde_json::from_value(v).unwrap()
    }

    /// JSON merge patch (RFC 7386), as `kubectl patch --type merge` applies it.
    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                }
            }
            (a, b) => *a = b,
        }
    }

    fn names<'a>(nodes: impl IntoIterator<Item = &'a model::Node>) -> Vec<&'a str> {
        nodes.into_iter().map(|n| n.name.as_str()).collect()
    }

    #[test]
    fn node_readiness_cordon_and_exclusion_follow_the_cluster() {
        use serde_json::json;
        let conditions_with = |t: &str, status: &str| {
            let mut c = api_node("x", "198.18.0.1", json!({}))
                .status
                .unwrap()
                .conditions
                .unwrap()
                .into_iter()
                .map(|c| json!({ "type": c.type_, "status": c.status }))
                .collect::<Vec<_>>();
            c.iter_mut().filter(|c| c["type"] == t).for_each(|c| c["status"] = status.into());
            json!({ "status": { "conditions": c } })
        };
        let nodes = [
            api_node("plain", "198.18.0.11", json!({})),
            // Ready, but the node controller has not lifted the taint admission put on the new Node.
            api_node("new", "198.18.0.12", json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/not-ready", "effect": "NoSchedule" }] } })),
            // The CNI has not set up the node's routes yet.
            api_node("no-network", "198.18.0.13", conditions_with("NetworkUnavailable", "True")),
            api_node("down", "198.18.0.14", conditions_with("Ready", "Unknown")),
            // `kubectl cordon`: the flag, and the taint the node controller adds for it.
            api_node(
                "cordoned",
                "198.18.0.15",
                json!({ "spec": { "unschedulable": true, "taints": [{ "key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule", "timeAdded": "2025-01-01T00:00:00Z" }] } }),
            ),
            // kubeadm's control-plane node: excluded from load balancers and tainted.
            api_node(
                "cp",
                "198.18.0.16",
                json!({
                    "metadata": { "labels": { "node-role.kubernetes.io/control-plane": "", "node.kubernetes.io/exclude-from-external-load-balancers": "" } },
                    "spec": { "taints": [{ "key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule" }] }
                }),
            ),
            // Excluded without any taint: still neither holder nor backend.
            api_node("excluded", "198.18.0.17", json!({ "metadata": { "labels": { "node.kubernetes.io/exclude-from-external-load-balancers": "true" } } })),
            // A pool toleration does not make a not-ready node ready.
            api_node("unreachable", "198.18.0.18", json!({ "spec": { "taints": [{ "key": "node.kubernetes.io/unreachable", "effect": "NoExecute" }] } })),
        ];
        let pools = [
            kpool("p", "addresses: [198.18.1.10-198.18.1.20]\nnodeSelector: {kubernetes.io/os: linux}\n"),
            kpool("all", "addresses: [198.18.2.10]\ntolerations: [{operator: Exists}]\n"),
        ];
        let svcs = [ksvc("web", Some("198.18.1.10"), false, &[("TCP", 80)])];
        let w = world_from(&nodes, &pools, &svcs, &[], &World::default());
        assert_eq!(names(&w.nodes), ["cordoned", "plain"], "not ready, no network, not-ready taints and the exclusion label leave nodes out");
        let why: Vec<(&str, &str)> = w.left_out.iter().map(|(n, r)| (n.as_str(), r.as_str())).collect();
        assert_eq!(
            why,
            [
                ("cp", "labelled node.kubernetes.io/exclude-from-external-load-balancers"),
                ("down", "not Ready"),
                ("excluded", "labelled node.kubernetes.io/exclude-from-external-load-balancers"),
                ("new", "tainted node.kubernetes.io/not-ready"),
                ("no-network", "NetworkUnavailable"),
                ("unreachable", "tainted node.kubernetes.io/unreachable"),
            ],
            "each left-out node with why"
        );
        assert_eq!(names(w.eligible(&w.pools[0])), ["cordoned", "plain"], "a cordoned node keeps holding VIPs");
        assert_eq!(names(w.eligible(&w.pools[1])), ["cordoned", "plain"], "tolerating everything does not bring back not-ready or excluded nodes");
        assert_eq!(names(w.backend_candidates(&w.services[0])), ["cordoned", "plain"], "a cordoned node stays a backend");
        let pool = &w.pools[0];
        let cordoned = w.node("cordoned").unwrap();
        assert!(cordoned.taints.iter().any(|t| t.key == UNSCHEDULABLE_TAINT), "the taint stays in the model, tolerated by the pool");
        assert!(pool.admits(cordoned));
    }

    /// The first InternalIP, of either family: an IPv6-only node, a dual-stack node
    /// of either primary family (kubelet lists it first); no InternalIP leaves it out.
    #[test]
    fn a_nodes_address_is_its_first_internal_ip() {
        use serde_json::json;
        let with = |addresses: serde_json::Value| json!({ "status": { "addresses": addresses } });
        let internal = |ip: &str| json!({ "type": "InternalIP", "address": ip });
        let nodes = [
            api_node("v4", "198.18.0.11", json!({})),
            api_node("v6", "2001:2::11", json!({})),
            api_node("v4-first", "x", with(json!([internal("198.18.0.13"), internal("2001:2::13")]))),
            api_node("v6-first", "x", with(json!([{ "type": "Hostname", "address": "v6-first" }, internal("2001:2::14"), internal("198.18.0.14")]))),
            api_node("none", "x", with(json!([{ "type": "ExternalIP", "address": "198.18.0.15" }]))),
        ];
        let w = world_from(&nodes, &[], &[], &[], &World::default());
        let addrs: Vec<(&str, String)> = w.nodes.iter().map(|n| (n.name.as_str(), n.addr.to_string())).collect();
        assert_eq!(addrs, [("v4", "198.18.0.11".into()), ("v4-first", "198.18.0.13".into()), ("v6", "2001:2::11".into()), ("v6-first", "2001:2::14".into())]);
        assert_eq!(w.left_out.get("none").map(String::as_str), Some("no InternalIP"));
    }

    #[test]
    fn health_checks_default_to_kube_proxy_on_the_node() {
        let probe = |check: &str, local: bool| {
            let nodes = [knode("n1", "198.18.0.11", true, &[], None)];
            let pools = [kpool("p", &format!("addresses: [198.18.1.10]\nhealthCheck: {check}\n"))];
            let svcs = [ksvc("web", Some("198.18.1.10"), local, &[("TCP", 443), ("TCP", 80)])];
            let w = world_from(&nodes, &pools, &svcs, &[], &World::default());
            w.services[0].health.clone().unwrap().probe
        };
        let http = |port: u16, path: &str| Probe::Http { port, path: path.into() };
        // externalTrafficPolicy: Cluster: kube-proxy's own health server, not NodeIP:443 where nothing listens.
        assert_eq!(probe("{type: http}", false), http(KUBE_PROXY_HEALTHZ_PORT, "/healthz"));
        assert_eq!(probe("{type: http, interval: 1s, timeout: 500ms, rise: 2, fall: 3}", false), http(10256, "/healthz"));
        // Local: the Service's healthCheckNodePort, whatever the pool says.
        assert_eq!(probe("{type: http}", true), http(32000, "/healthz"));
        assert_eq!(probe("{type: tcp, port: 9000}", true), http(32000, "/healthz"));
        // Named explicitly: as written; without a port, `type: tcp` or a path keep probing the Service's first port.
        assert_eq!(probe("{type: http, port: 10256, path: /livez}", false), http(10256, "/livez"));
        assert_eq!(probe("{type: http, path: /ready}", false), http(443, "/ready"));
        assert_eq!(probe("{type: http, port: 8080, path: /ready}", false), http(8080, "/ready"));
        assert_eq!(probe("{type: tcp, port: 9000}", false), Probe::Tcp { port: 9000 });
        assert_eq!(probe("{type: tcp}", false), Probe::Tcp { port: 443 });
    }
}
