//! IP allocation for Services of type LoadBalancer, computed from the API objects
//! alone (the addresses already in Services' `status.loadBalancer.ingress` are the
//! truth), so a new leader or a restarted agent continues without double
//! allocation. Pure: the elected controller applies the decisions it returns.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use k8s_openapi::{api::core::v1::Service, apimachinery::pkg::apis::meta::v1::LabelSelector};

/// Our `spec.loadBalancerClass`; Services without a class are ours too.
pub const LB_CLASS: &str = "vip.dev/vip";
/// Annotation asking for a specific address (like the deprecated `spec.loadBalancerIP`).
pub const ANNOTATION_ADDRESS: &str = "vip.dev/address";
/// Services with equal values may share one address when their ports do not overlap.
pub const ANNOTATION_SHARING_KEY: &str = "vip.dev/sharing-key";

/// A valid pool as the allocator needs it.
#[derive(Clone, Debug)]
pub struct PoolView {
    pub name: String,
    pub addresses: BTreeSet<Ipv4Addr>,
    pub auto_assign: bool,
    pub service_selector: Option<LabelSelector>,
    pub namespace_selector: Option<LabelSelector>,
}

/// What should change on one Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write this address to `status.loadBalancer.ingress` (from `pool`).
    Allocate { service: String, addr: Ipv4Addr, pool: String },
    /// Clear our address from the status (type or class changed, pool gone).
    Release { service: String, addr: Ipv4Addr, why: String },
    /// Cannot allocate now; reported as an event and retried on the next change.
    Pending { service: String, why: String },
    /// The Service keeps `addr` although the selectors of its pool no longer admit
    /// it: an edited pool does not take the address of a running Service (its
    /// configuration goes stale rather than broken). Reported, nothing written.
    Stale { service: String, addr: Ipv4Addr, pool: String, why: String },
}

/// `namespace/name`.
pub fn key(s: &Service) -> String {
    format!("{}/{}", s.metadata.namespace.as_deref().unwrap_or("default"), s.metadata.name.as_deref().unwrap_or(""))
}

/// Whether we serve this Service's load balancer (type LoadBalancer, class ours or unset).
pub fn is_ours(s: &Service) -> bool {
    let spec = s.spec.as_ref();
    spec.and_then(|p| p.type_.as_deref()) == Some("LoadBalancer") && spec.and_then(|p| p.load_balancer_class.as_deref()).is_none_or(|c| c == LB_CLASS)
}

/// Why a Service is not ours (for a `Released` Event): its type or its class.
pub fn why_not_ours(s: &Service) -> String {
    let spec = s.spec.as_ref();
    match (spec.and_then(|p| p.type_.as_deref()), spec.and_then(|p| p.load_balancer_class.as_deref())) {
        (Some("LoadBalancer"), Some(c)) => format!("no longer a LoadBalancer of ours (loadBalancerClass {c})"),
        (t, _) => format!("no longer a LoadBalancer of ours (type {})", t.unwrap_or("ClusterIP")),
    }
}

pub(super) fn ingress_ips(s: &Service) -> Vec<Ipv4Addr> {
    s.status
        .as_ref()
        .and_then(|st| st.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref())
        .map(|v| v.iter().filter_map(|i| i.ip.as_deref()?.parse().ok()).collect())
        .unwrap_or_default()
}

/// The address the Service asks for, if any (annotation first, then `loadBalancerIP`).
pub fn requested(s: &Service) -> Option<Result<Ipv4Addr, String>> {
    let ann = s.metadata.annotations.as_ref().and_then(|a| a.get(ANNOTATION_ADDRESS)).cloned();
    let field = s.spec.as_ref().and_then(|p| p.load_balancer_ip.clone()).filter(|x| !x.is_empty());
    let raw = ann.or(field)?;
    Some(raw.parse().map_err(|_| format!("requested address {raw:?} is not an IPv4 address")))
}

fn sharing_key(s: &Service) -> Option<&str> {
    s.metadata.annotations.as_ref()?.get(ANNOTATION_SHARING_KEY).map(String::as_str)
}

/// (protocol, port) pairs of the Service.
fn ports(s: &Service) -> BTreeSet<(String, i32)> {
    s.spec
        .as_ref()
        .and_then(|p| p.ports.as_ref())
        .map(|ps| ps.iter().map(|p| (p.protocol.clone().unwrap_or_else(|| "TCP".into()), p.port)).collect())
        .unwrap_or_default()
}

/// matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist).
pub fn label_selector_matches(sel: &LabelSelector, labels: &BTreeMap<String, String>) -> bool {
    let ml = sel.match_labels.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let me = sel.match_expressions.iter().flatten().all(|e| {
        let vals = e.values.clone().unwrap_or_default();
        match e.operator.as_str() {
            "In" => labels.get(&e.key).is_some_and(|v| vals.contains(v)),
            "NotIn" => labels.get(&e.key).is_none_or(|v| !vals.contains(v)),
            "Exists" => labels.contains_key(&e.key),
            "DoesNotExist" => !labels.contains_key(&e.key),
            _ => false,
        }
    });
    ml && me
}

fn pool_admits(p: &PoolView, s: &Service, ns_labels: &BTreeMap<String, BTreeMap<String, String>>) -> bool {
    let labels = s.metadata.labels.clone().unwrap_or_default();
    let ns = s.metadata.namespace.clone().unwrap_or_else(|| "default".into());
    p.service_selector.as_ref().is_none_or(|sel| label_selector_matches(sel, &labels))
        && p.namespace_selector.as_ref().is_none_or(|sel| label_selector_matches(sel, ns_labels.get(&ns).unwrap_or(&BTreeMap::new())))
}

/// Who uses each address: (service key, sharing key, ports).
type Usage = BTreeMap<Ipv4Addr, Vec<(String, Option<String>, BTreeSet<(String, i32)>)>>;

fn can_share(usage: &Usage, addr: Ipv4Addr, me: &str, key: Option<&str>, my_ports: &BTreeSet<(String, i32)>) -> bool {
    usage
        .get(&addr)
        .is_none_or(|users| users.iter().filter(|(svc, _, _)| svc != me).all(|(_, k, p)| key.is_some() && k.as_deref() == key && p.is_disjoint(my_ports)))
}

/// Decides allocations for every Service. Services are taken in a fixed order
/// (those holding an address first, then by creation time and name), so the result
/// does not depend on the order of the input or on which agent computes it.
pub fn allocate(pools: &[PoolView], services: &[Service], ns_labels: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Decision> {
    let pool_of = |a: Ipv4Addr| pools.iter().find(|p| p.addresses.contains(&a));
    let mut order: Vec<&Service> = services.iter().collect();
    order.sort_by_key(|s| (ingress_ips(s).is_empty(), s.metadata.creation_timestamp.as_ref().map(|t| t.0), key(s)));
    let mut usage: Usage = BTreeMap::new();
    let mut out = Vec::new();
    for s in order {
        let me = key(s);
        let held: Vec<Ipv4Addr> = ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_some()).collect();
        let my_ports = ports(s);
        let share = sharing_key(s);
        if !is_ours(s) {
            for a in held {
                out.push(Decision::Release { service: me.clone(), addr: a, why: why_not_ours(s) });
            }
            continue;
        }
        // Our Services' statuses are ours: an address in no pool (its pool was
        // deleted or narrowed) is served by nobody and goes.
        for a in ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_none()) {
            out.push(Decision::Release { service: me.clone(), addr: a, why: "the address is in no VipPool".into() });
        }
        let want = requested(s);
        // Keep a held address that still fits (requested one, not taken). One its
        // pool's selectors no longer admit (the pool, the Service's labels or its
        // namespace's changed) is kept too, and reported: a running Service does not
        // lose its address to an edit elsewhere.
        let keep = held.iter().copied().find(|a| {
            let fits_request = match &want {
                Some(Ok(r)) => r == a,
                Some(Err(_)) => false,
                None => true,
            };
            fits_request && can_share(&usage, *a, &me, share, &my_ports)
        });
        if let Some(p) = keep.and_then(pool_of).filter(|p| !pool_admits(p, s, ns_labels)) {
            let addr = keep.expect("kept");
            let why = format!(
                "{addr} kept although the selectors of VipPool {:?} no longer admit this Service; recreate it or ask for another address ({ANNOTATION_ADDRESS}) to move it",
                p.name
            );
            out.push(Decision::Stale { service: me.clone(), addr, pool: p.name.clone(), why });
        }
        for a in held.iter().filter(|a| Some(**a) != keep) {
            out.push(Decision::Release { service: me.clone(), addr: *a, why: "the address no longer fits the Service or its pool".into() });
        }
        let chosen = match (keep, &want) {
            (Some(a), _) => Ok((a, None)),
            (None, Some(Err(e))) => Err(e.clone()),
            (None, Some(Ok(r))) => match pool_of(*r) {
                None => Err(format!("requested address {r} is in no VipPool")),
                Some(p) if !pool_admits(p, s, ns_labels) => {
                    Err(format!("requested address {r} is in pool {:?}, whose selectors do not admit this Service", p.name))
                }
                Some(_) if !can_share(&usage, *r, &me, share, &my_ports) => {
                    Err(format!("requested address {r} is in use by another Service (share it with a common {ANNOTATION_SHARING_KEY} and distinct ports)"))
                }
                Some(p) => Ok((*r, Some(p.name.clone()))),
            },
            (None, None) => {
                let mut found = None;
                for p in pools.iter().filter(|p| p.auto_assign && pool_admits(p, s, ns_labels)) {
                    // A shareable address already used with our key first, then the lowest free one.
                    let shared =
                        share.and_then(|_| p.addresses.iter().copied().find(|a| usage.contains_key(a) && can_share(&usage, *a, &me, share, &my_ports)));
                    if let Some(a) = shared.or_else(|| p.addresses.iter().copied().find(|a| !usage.contains_key(a))) {
                        found = Some((a, Some(p.name.clone())));
                        break;
                    }
                }
                found.ok_or_else(|| "no VipPool with autoAssign admits this Service and has a free address".to_owned())
            }
        };
        match chosen {
            Ok((a, pool)) => {
                usage.entry(a).or_default().push((me.clone(), share.map(str::to_owned), my_ports));
                if let Some(pool) = pool {
                    out.push(Decision::Allocate { service: me, addr: a, pool });
                }
            }
            Err(why) => out.push(Decision::Pending { service: me, why }),
        }
    }
    out
}

/// (allocated, free) addresses of each pool, from the Services' statuses.
pub fn pool_usage(pools: &[PoolView], services: &[Service]) -> BTreeMap<String, (u32, u32)> {
    let used: BTreeSet<Ipv4Addr> = services.iter().filter(|s| is_ours(s)).flat_map(ingress_ips).collect();
    pools
        .iter()
        .map(|p| {
            let n = p.addresses.iter().filter(|a| used.contains(a)).count() as u32;
            (p.name.clone(), (n, p.addresses.len() as u32 - n))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServicePort, ServiceSpec, ServiceStatus},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };

    use super::*;

    fn pool(name: &str, first: u8, n: u8, auto: bool) -> PoolView {
        PoolView {
            name: name.into(),
            addresses: (first..first + n).map(|i| Ipv4Addr::new(198, 18, 1, i)).collect(),
            auto_assign: auto,
            service_selector: None,
            namespace_selector: None,
        }
    }

    fn svc(name: &str, t: i64, ports: &[i32]) -> Service {
        Service {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("default".into()),
                creation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + t).unwrap())),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                type_: Some("LoadBalancer".into()),
                ports: Some(ports.iter().map(|&p| ServicePort { port: p, protocol: Some("TCP".into()), ..Default::default() }).collect()),
                ..Default::default()
            }),
            status: None,
        }
    }

    fn with_ip(mut s: Service, ip: &str) -> Service {
        s.status = Some(ServiceStatus {
            load_balancer: Some(LoadBalancerStatus { ingress: Some(vec![LoadBalancerIngress { ip: Some(ip.into()), ..Default::default() }]) }),
            ..Default::default()
        });
        s
    }

    fn annotate(mut s: Service, k: &str, v: &str) -> Service {
        s.metadata.annotations.get_or_insert_with(Default::default).insert(k.into(), v.into());
        s
    }

    fn alloc(d: &[Decision]) -> Vec<(String, String)> {
        d.iter()
            .filter_map(|x| match x {
                Decision::Allocate { service, addr, .. } => Some((service.clone(), addr.to_string())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn lowest_free_in_creation_order_and_existing_kept() {
        let pools = [pool("a", 10, 3, true)];
        let svcs = [svc("late", 5, &[80]), with_ip(svc("old", 9, &[80]), "198.18.1.10"), svc("early", 1, &[80])];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert_eq!(alloc(&d), [("default/early".into(), "198.18.1.11".into()), ("default/late".into(), "198.18.1.12".into())]);
        // Order of the input does not matter.
        let rev: Vec<Service> = svcs.iter().rev().cloned().collect();
        assert_eq!(allocate(&pools, &rev, &BTreeMap::new()), d);
    }

    #[test]
    fn exhausted_pool_and_requests() {
        let pools = [pool("a", 10, 1, true), pool("manual", 20, 2, false)];
        let svcs = [
            with_ip(svc("has", 0, &[80]), "198.18.1.10"),
            svc("none-left", 1, &[80]),
            annotate(svc("asks", 2, &[80]), ANNOTATION_ADDRESS, "198.18.1.21"),
            annotate(svc("asks-taken", 3, &[80]), ANNOTATION_ADDRESS, "198.18.1.10"),
            annotate(svc("asks-outside", 4, &[80]), ANNOTATION_ADDRESS, "198.18.9.9"),
        ];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert_eq!(alloc(&d), [("default/asks".into(), "198.18.1.21".into())], "manual pool only by request: {d:?}");
        let pending: Vec<&str> = d.iter().filter_map(|x| if let Decision::Pending { why, .. } = x { Some(why.as_str()) } else { None }).collect();
        assert_eq!(pending.len(), 3, "{d:?}");
        assert!(pending[0].contains("no VipPool with autoAssign"));
        assert!(pending[1].contains("in use by another Service"));
        assert!(pending[2].contains("in no VipPool"));
    }

    #[test]
    fn sharing_key_shares_one_address_when_ports_differ() {
        let pools = [pool("a", 10, 2, true)];
        let k = ANNOTATION_SHARING_KEY;
        let svcs = [
            annotate(with_ip(svc("web", 0, &[80]), "198.18.1.10"), k, "front"),
            annotate(svc("tls", 1, &[443]), k, "front"),
            annotate(svc("clash", 2, &[80]), k, "front"),
        ];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert_eq!(alloc(&d), [("default/tls".into(), "198.18.1.10".into()), ("default/clash".into(), "198.18.1.11".into())]);
    }

    #[test]
    fn released_when_no_longer_ours_or_outside_pools() {
        let pools = [pool("a", 10, 2, true)];
        let mut cluster_ip = with_ip(svc("was-lb", 0, &[80]), "198.18.1.10");
        cluster_ip.spec.as_mut().unwrap().type_ = Some("ClusterIP".into());
        let mut other_class = with_ip(svc("other", 1, &[80]), "198.18.1.11");
        other_class.spec.as_mut().unwrap().load_balancer_class = Some("example.com/other".into());
        let foreign = with_ip(svc("foreign", 2, &[80]), "203.0.113.5");
        let d = allocate(&pools, &[cluster_ip, other_class, foreign], &BTreeMap::new());
        let released: Vec<String> =
            d.iter().filter_map(|x| if let Decision::Release { addr, why, .. } = x { Some(format!("{addr} {why}")) } else { None }).collect();
        assert_eq!(
            released,
            [
                "198.18.1.10 no longer a LoadBalancer of ours (type ClusterIP)",
                "198.18.1.11 no longer a LoadBalancer of ours (loadBalancerClass example.com/other)",
                "203.0.113.5 the address is in no VipPool"
            ]
        );
        // Ours with an address in no pool: that one goes, one of ours comes.
        assert_eq!(alloc(&d), [("default/foreign".into(), "198.18.1.10".into())]);
    }

    #[test]
    fn selectors_choose_the_pool() {
        let mut only_prod = pool("prod", 10, 1, true);
        only_prod.namespace_selector = Some(LabelSelector { match_labels: Some([("env".to_owned(), "prod".to_owned())].into()), ..Default::default() });
        let pools = [only_prod, pool("rest", 20, 1, true)];
        let mut s = svc("web", 0, &[80]);
        s.metadata.namespace = Some("shop".into());
        let ns: BTreeMap<String, BTreeMap<String, String>> = [("shop".to_owned(), [("env".to_owned(), "prod".to_owned())].into())].into();
        assert_eq!(alloc(&allocate(&pools, &[s.clone()], &ns)), [("shop/web".into(), "198.18.1.10".into())]);
        assert_eq!(alloc(&allocate(&pools, &[s], &BTreeMap::new())), [("shop/web".into(), "198.18.1.20".into())]);
    }

    #[test]
    fn narrowed_selectors_keep_a_running_services_address() {
        let mut only_prod = pool("prod", 10, 2, true);
        only_prod.namespace_selector = Some(LabelSelector { match_labels: Some([("env".to_owned(), "prod".to_owned())].into()), ..Default::default() });
        let pools = [only_prod];
        let running = with_ip(svc("running", 0, &[80]), "198.18.1.10");
        let d = allocate(&pools, &[running.clone(), svc("new", 1, &[80])], &BTreeMap::new());
        assert!(
            matches!(&d[0], Decision::Stale { service, addr, pool, why } if service == "default/running" && addr.to_string() == "198.18.1.10" && pool == "prod" && why.contains("no longer admit")),
            "{d:?}"
        );
        assert!(!d.iter().any(|x| matches!(x, Decision::Release { .. })), "{d:?}");
        assert!(matches!(&d[1], Decision::Pending { service, .. } if service == "default/new"), "{d:?}");
        // Admitted again: nothing to say.
        let ns: BTreeMap<String, BTreeMap<String, String>> = [("default".to_owned(), [("env".to_owned(), "prod".to_owned())].into())].into();
        assert!(allocate(&pools, &[running], &ns).is_empty());
    }

    #[test]
    fn usage_counts() {
        let pools = [pool("a", 10, 3, true)];
        let u = pool_usage(&pools, &[with_ip(svc("x", 0, &[80]), "198.18.1.11")]);
        assert_eq!(u["a"], (1, 2));
    }
}
