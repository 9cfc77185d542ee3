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
            distribution: v.distribution,
            garp: v.garp,
            interfaces: v.interfaces.clone(),
            vlan: v.vlan,
            bgp: Default::default(),
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
mod tests;
