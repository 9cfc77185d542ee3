//! The Kubernetes source: the same model the YAML file fills, built from Nodes,
//! VipPools, Services and EndpointSlices. Pure (`world_from`); the watching side
//! feeds it the reflectors' current objects.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
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
use crate::model::{self, HealthCheck, Probe, Protocol, World};

/// The label EndpointSlices carry with their Service's name.
const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

fn node_from(n: &KNode) -> Option<model::Node> {
    let status = n.status.as_ref()?;
    let ready = status.conditions.iter().flatten().any(|c| c.type_ == "Ready" && c.status == "True");
    if !ready {
        return None;
    }
    let addr: Ipv4Addr = status.addresses.iter().flatten().find(|a| a.type_ == "InternalIP").and_then(|a| a.address.parse().ok())?;
    let taints = n
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .into_iter()
        .flatten()
        .filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute")
        .map(|t| model::Taint { key: t.key.clone(), value: t.value.clone().unwrap_or_default(), effect: t.effect.clone() })
        .collect();
    Some(model::Node { name: n.name_any(), addr, mac: None, labels: n.labels().clone(), taints })
}

/// Nodes with a ready endpoint of `svc` (for `externalTrafficPolicy: Local`).
fn local_endpoint_nodes(svc: &KService, slices: &[EndpointSlice]) -> BTreeSet<String> {
    let ns = svc.namespace();
    slices
        .iter()
        .filter(|s| s.namespace() == ns && s.labels().get(SERVICE_NAME_LABEL) == Some(&svc.name_any()))
        .flat_map(|s| s.endpoints.iter())
        .filter(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true))
        .filter_map(|e| e.node_name.clone())
        .collect()
}

/// Watches Nodes, VipPools, Services and EndpointSlices and publishes the model
/// built from them (after the first complete view, then on every change, bursts
/// coalesced). `base` as for `world_from`.
pub async fn watch_world(client: kube::Client, base: World) -> tokio::sync::watch::Receiver<World> {
    use kube::Api;
    let (tx, mut changed) = tokio::sync::mpsc::unbounded_channel();
    let nodes = super::reflect(Api::<KNode>::all(client.clone()), tx.clone());
    let pools = super::reflect(Api::<VipPool>::all(client.clone()), tx.clone());
    let services = super::reflect(Api::<KService>::all(client.clone()), tx.clone());
    let slices = super::reflect(Api::<EndpointSlice>::all(client), tx);
    let _ = nodes.wait_until_ready().await;
    let _ = pools.wait_until_ready().await;
    let _ = services.wait_until_ready().await;
    let _ = slices.wait_until_ready().await;
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
    rx
}

/// Builds the model. `base` carries the settings the cluster objects do not
/// (announce and failover timers, Maglev seed); its nodes, pools and services are replaced.
pub fn world_from(nodes: &[KNode], pools: &[VipPool], services: &[KService], slices: &[EndpointSlice], base: &World) -> World {
    let mut w = World { nodes: nodes.iter().filter_map(node_from).collect(), ..base.clone() };
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
            .collect();
        w.pools.push(model::Pool {
            name: c.name.clone(),
            addresses: v.addresses.clone(),
            node_selector: p.spec.node_selector.clone(),
            tolerations,
            announce: v.announce,
            garp: v.garp,
        });
        valid.push((p, v));
    }
    for svc in services {
        let spec = svc.spec.clone().unwrap_or_default();
        let mut vips: Vec<Ipv4Addr> = Vec::new();
        if allocate::is_ours(svc) {
            vips.extend(
                svc.status
                    .iter()
                    .flat_map(|s| s.load_balancer.iter())
                    .flat_map(|lb| lb.ingress.iter().flatten())
                    .filter_map(|i| i.ip.as_deref()?.parse::<Ipv4Addr>().ok()),
            );
        }
        vips.extend(spec.external_ips.iter().flatten().filter_map(|a| a.parse::<Ipv4Addr>().ok()));
        let local = spec.external_traffic_policy.as_deref() == Some("Local");
        for vip in vips {
            let Some((pool, v)) = valid.iter().find(|(_, v)| v.addresses.binary_search(&vip).is_ok()) else { continue };
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
                    _ => v.health.clone().map(|mut h| {
                        // A pool's check without a port probes each Service's first port.
                        if pool.spec.health_check.as_ref().is_some_and(|c| c.port.is_none()) {
                            h.probe = match h.probe {
                                Probe::Tcp { .. } => Probe::Tcp { port: ports[0] },
                                Probe::Http { path, .. } => Probe::Http { port: ports[0], path },
                            };
                        }
                        h
                    }),
                };
                let name = if spec.ports.iter().flatten().any(|p| p.protocol.as_deref() == Some("UDP")) && protocol == Protocol::Udp {
                    format!("{}/udp", key(svc))
                } else {
                    key(svc)
                };
                w.services.push(model::Service {
                    name,
                    vip,
                    ports,
                    protocol,
                    table_size: v.table_size,
                    backend_selector: pool.spec.node_selector.clone(),
                    backend_nodes: local.then(|| local_endpoint_nodes(svc, slices)),
                    health,
                });
            }
        }
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
    }

    #[test]
    fn tolerated_taints_keep_nodes_eligible() {
        let nodes = [knode("n2", "198.18.0.12", true, &[], Some("dedicated"))];
        let pools = [kpool("p", "addresses: [198.18.1.10]\ntolerations: [{key: dedicated, operator: Exists}]\n")];
        let w = world_from(&nodes, &pools, &[], &[], &World::default());
        assert_eq!(w.eligible(&w.pools[0]).len(), 1);
    }
}
