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
/// Annotation naming the VipPool to allocate from (also one with `autoAssign: false`).
pub const ANNOTATION_POOL: &str = "vip.dev/pool";

/// MetalLB's annotations, newer form first, honoured so that Services keep working
/// when vip replaces MetalLB. vip's own annotation wins when both are set.
pub const METALLB_ADDRESSES: [&str; 2] = ["metallb.io/loadBalancerIPs", "metallb.universe.tf/loadBalancerIPs"];
pub const METALLB_POOL: [&str; 2] = ["metallb.io/address-pool", "metallb.universe.tf/address-pool"];
pub const METALLB_SHARING_KEY: [&str; 2] = ["metallb.io/allow-shared-ip", "metallb.universe.tf/allow-shared-ip"];

/// vip's annotation and MetalLB's forms of it, in the order they are looked up.
const ANNOTATIONS: [(&str, [&str; 2]); 3] =
    [(ANNOTATION_ADDRESS, METALLB_ADDRESSES), (ANNOTATION_POOL, METALLB_POOL), (ANNOTATION_SHARING_KEY, METALLB_SHARING_KEY)];

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

/// The first of `own` and MetalLB's forms of it that the Service sets: (name, value).
fn annotation<'a>(s: &'a Service, own: &'static str) -> Option<(&'static str, &'a str)> {
    let a = s.metadata.annotations.as_ref()?;
    let metallb = ANNOTATIONS.iter().find(|(o, _)| *o == own).map_or(&[][..], |(_, m)| &m[..]);
    std::iter::once(own).chain(metallb.iter().copied()).find_map(|k| Some((k, a.get(k)?.as_str())))
}

/// The address the Service asks for, if any: `vip.dev/address`, else MetalLB's
/// `loadBalancerIPs`, else `spec.loadBalancerIP`.
pub fn requested(s: &Service) -> Option<Result<Ipv4Addr, String>> {
    match annotation(s, ANNOTATION_ADDRESS) {
        Some((ANNOTATION_ADDRESS, raw)) => Some(raw.parse().map_err(|_| format!("requested address {raw:?} is not an IPv4 address"))),
        Some((name, raw)) => Some(metallb_addresses(name, raw).and_then(|(v4, _)| v4.ok_or_else(|| only_ipv6(name, raw)))),
        None => {
            let raw = s.spec.as_ref().and_then(|p| p.load_balancer_ip.clone()).filter(|x| !x.is_empty())?;
            Some(raw.parse().map_err(|_| format!("requested address {raw:?} is not an IPv4 address")))
        }
    }
}

/// MetalLB's `loadBalancerIPs`: comma-separated, at most one address per family.
/// (the IPv4 one, the IPv6 one); errors name the annotation.
fn metallb_addresses(name: &str, raw: &str) -> Result<(Option<Ipv4Addr>, Option<std::net::Ipv6Addr>), String> {
    let (mut v4, mut v6) = (None, None);
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let ip: std::net::IpAddr = part.parse().map_err(|_| format!("{name}: {part:?} is not an IP address"))?;
        let taken = match ip {
            std::net::IpAddr::V4(a) => v4.replace(a).is_some(),
            std::net::IpAddr::V6(a) => v6.replace(a).is_some(),
        };
        if taken {
            return Err(format!("{name}: {raw:?} names more than one address of a family (one IPv4 and one IPv6 at most)"));
        }
    }
    if v4.is_none() && v6.is_none() {
        return Err(format!("{name} names no address"));
    }
    Ok((v4, v6))
}

fn only_ipv6(name: &str, raw: &str) -> String {
    format!("{name} asks only for an IPv6 address ({raw}): vip serves IPv4 addresses only; add an IPv4 address or remove the annotation")
}

/// The VipPool the Service asks to be allocated from: (annotation, pool name).
pub fn requested_pool(s: &Service) -> Option<(&'static str, &str)> {
    annotation(s, ANNOTATION_POOL)
}

fn sharing_key(s: &Service) -> Option<&str> {
    annotation(s, ANNOTATION_SHARING_KEY).map(|(_, v)| v)
}

/// What the Service's MetalLB annotations do, for a Warning suggesting vip's own
/// (None: it has none). Each is honoured, or ignored when vip's own annotation (or
/// MetalLB's newer form) is set too.
pub fn metallb_note(s: &Service) -> Option<String> {
    let a = s.metadata.annotations.as_ref()?;
    let mut said = Vec::new();
    for (own, metallb) in ANNOTATIONS {
        for m in metallb.into_iter().filter(|m| a.contains_key(*m)) {
            // The first of vip's and MetalLB's forms that is set (`m` at the latest).
            let used = annotation(s, own).map_or(m, |(k, _)| k);
            said.push(if used == m {
                {
                    let v6 = (own == ANNOTATION_ADDRESS)
                        .then(|| metallb_addresses(m, &a[m]).ok().and_then(|(v4, v6)| v4.and(v6)))
                        .flatten()
                        .map_or_else(String::new, |v6| format!(" (its IPv6 address {v6} is ignored: vip serves IPv4 only)"));
                    format!("{m} is honoured{v6}: use {own} instead")
                }
            } else {
                format!("{m} is ignored: {used} is set too and wins")
            });
        }
    }
    (!said.is_empty()).then(|| format!("MetalLB annotations: {}", said.join("; ")))
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
    // Every kept address is taken before any Service is given a new one: a Service
    // whose address went (its pool was deleted) must not take the address a Service
    // later in the order still holds.
    let mut to_choose = Vec::new();
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
        let want_pool = requested_pool(s);
        let in_wanted_pool = |a: Ipv4Addr| want_pool.is_none_or(|(_, name)| pool_of(a).is_some_and(|p| p.name == name));
        // Keep a held address that still fits (requested one, in the requested pool,
        // not taken): an address another implementation (MetalLB) gave the Service
        // stays too, so switching to vip changes no Service's address. One its
        // pool's selectors no longer admit (the pool, the Service's labels or its
        // namespace's changed) is kept too, and reported: a running Service does not
        // lose its address to an edit elsewhere.
        let keep = held.iter().copied().find(|a| {
            let fits_request = match &want {
                Some(Ok(r)) => r == a,
                Some(Err(_)) => false,
                None => true,
            };
            fits_request && in_wanted_pool(*a) && can_share(&usage, *a, &me, share, &my_ports)
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
        match keep {
            Some(a) => usage.entry(a).or_default().push((me, share.map(str::to_owned), my_ports)),
            None => to_choose.push(s),
        }
    }
    for s in to_choose {
        let me = key(s);
        let my_ports = ports(s);
        let share = sharing_key(s);
        let want = requested(s);
        let want_pool = requested_pool(s);
        let in_wanted_pool = |a: Ipv4Addr| want_pool.is_none_or(|(_, name)| pool_of(a).is_some_and(|p| p.name == name));
        let chosen = match &want {
            Some(Err(e)) => Err(e.clone()),
            Some(Ok(r)) => match pool_of(*r) {
                None => Err(format!("requested address {r} is in no VipPool")),
                Some(p) if !in_wanted_pool(*r) => {
                    let (ann, name) = want_pool.expect("a requested pool");
                    Err(format!("requested address {r} is in VipPool {:?}, not in {name:?} ({ann})", p.name))
                }
                Some(p) if !pool_admits(p, s, ns_labels) => {
                    Err(format!("requested address {r} is in pool {:?}, whose selectors do not admit this Service", p.name))
                }
                Some(_) if !can_share(&usage, *r, &me, share, &my_ports) => {
                    Err(format!("requested address {r} is in use by another Service (share it with a common {ANNOTATION_SHARING_KEY} and distinct ports)"))
                }
                Some(p) => Ok((*r, p.name.clone())),
            },
            None => {
                // A named pool is used whatever its autoAssign (as MetalLB does).
                let candidates: Vec<&PoolView> = match want_pool {
                    Some((_, name)) => pools.iter().filter(|p| p.name == name).collect(),
                    None => pools.iter().filter(|p| p.auto_assign).collect(),
                };
                let mut found = None;
                for p in candidates.iter().copied().filter(|p| pool_admits(p, s, ns_labels)) {
                    // A shareable address already used with our key first, then the lowest free one.
                    let shared =
                        share.and_then(|_| p.addresses.iter().copied().find(|a| usage.contains_key(a) && can_share(&usage, *a, &me, share, &my_ports)));
                    if let Some(a) = shared.or_else(|| p.addresses.iter().copied().find(|a| !usage.contains_key(a))) {
                        found = Some((a, p.name.clone()));
                        break;
                    }
                }
                found.ok_or_else(|| match (want_pool, candidates.first()) {
                    (None, _) => "no VipPool with autoAssign admits this Service and has a free address".to_owned(),
                    (Some((ann, name)), None) => format!("no valid VipPool named {name:?} ({ann})"),
                    (Some((ann, name)), Some(p)) if !pool_admits(p, s, ns_labels) => {
                        format!("VipPool {name:?} ({ann}) does not admit this Service (its selectors)")
                    }
                    (Some((ann, name)), Some(_)) => format!("VipPool {name:?} ({ann}) has no free address"),
                })
            }
        };
        match chosen {
            Ok((a, pool)) => {
                usage.entry(a).or_default().push((me.clone(), share.map(str::to_owned), my_ports));
                out.push(Decision::Allocate { service: me, addr: a, pool });
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
    fn an_address_still_held_is_never_given_to_a_service_earlier_in_the_order() {
        // "early" lost its address (its pool went); "late" holds the pool's only one.
        let pools = [pool("a", 30, 1, true)];
        let svcs = [with_ip(svc("early", 0, &[80]), "198.18.1.12"), with_ip(svc("late", 1, &[80]), "198.18.1.30")];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert!(alloc(&d).is_empty(), "{d:?}");
        assert!(d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/early")), "{d:?}");
        assert!(!d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/late")), "{d:?}");
        assert!(d.iter().any(|x| matches!(x, Decision::Pending { service, .. } if service == "default/early")), "{d:?}");
        // An address asked for is no different.
        let svcs = [annotate(svcs[0].clone(), ANNOTATION_ADDRESS, "198.18.1.30"), svcs[1].clone()];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert!(alloc(&d).is_empty(), "{d:?}");
        assert!(!d.iter().any(|x| matches!(x, Decision::Release { service, .. } if service == "default/late")), "{d:?}");
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

    fn pending(d: &[Decision]) -> Vec<(String, String)> {
        d.iter().filter_map(|x| if let Decision::Pending { service, why } = x { Some((service.clone(), why.clone())) } else { None }).collect()
    }

    #[test]
    fn metallb_load_balancer_ips_are_honoured_ipv4_taken_vip_wins() {
        let pools = [pool("a", 10, 5, true)];
        let svcs = [
            annotate(svc("new-form", 0, &[80]), METALLB_ADDRESSES[0], "198.18.1.12"),
            annotate(svc("old-form", 1, &[80]), METALLB_ADDRESSES[1], "198.18.1.13"),
            annotate(svc("dual", 2, &[80]), METALLB_ADDRESSES[0], "2001:db8::5, 198.18.1.14"),
            annotate(annotate(svc("both", 3, &[80]), METALLB_ADDRESSES[0], "198.18.1.10"), ANNOTATION_ADDRESS, "198.18.1.11"),
            annotate(svc("v6-only", 4, &[80]), METALLB_ADDRESSES[0], "2001:db8::6"),
            annotate(svc("two-v4", 5, &[80]), METALLB_ADDRESSES[0], "198.18.1.10,198.18.1.10"),
            annotate(svc("junk", 6, &[80]), METALLB_ADDRESSES[1], "198.18.1.x"),
        ];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert_eq!(
            alloc(&d),
            [
                ("default/new-form".into(), "198.18.1.12".into()),
                ("default/old-form".into(), "198.18.1.13".into()),
                ("default/dual".into(), "198.18.1.14".into()),
                ("default/both".into(), "198.18.1.11".into()),
            ]
        );
        let p = pending(&d);
        assert_eq!(p.len(), 3, "{d:?}");
        assert_eq!(p[0].0, "default/v6-only");
        assert!(p[0].1.starts_with("metallb.io/loadBalancerIPs asks only for an IPv6 address (2001:db8::6): vip serves IPv4 addresses only"), "{}", p[0].1);
        assert!(p[1].1.contains("more than one address of a family"), "{}", p[1].1);
        assert_eq!(p[2].1, "metallb.universe.tf/loadBalancerIPs: \"198.18.1.x\" is not an IP address");
        // The Warnings' notes: honoured (with the IPv6 part ignored) or overridden.
        assert_eq!(metallb_note(&svcs[0]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead");
        assert_eq!(
            metallb_note(&svcs[2]).unwrap(),
            "MetalLB annotations: metallb.io/loadBalancerIPs is honoured (its IPv6 address 2001:db8::5 is ignored: vip serves IPv4 only): use vip.dev/address instead"
        );
        assert_eq!(metallb_note(&svcs[3]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is ignored: vip.dev/address is set too and wins");
        assert_eq!(metallb_note(&svc("plain", 0, &[80])), None);
        assert_eq!(metallb_note(&annotate(svc("x", 0, &[80]), ANNOTATION_ADDRESS, "198.18.1.10")), None, "vip's own alone: nothing to say");
    }

    #[test]
    fn metallb_address_pool_names_the_pool_even_without_auto_assign() {
        let pools = [pool("auto", 10, 2, true), pool("manual", 20, 2, false)];
        let svcs = [
            annotate(svc("named", 0, &[80]), METALLB_POOL[0], "manual"),
            annotate(svc("old-form", 1, &[80]), METALLB_POOL[1], "manual"),
            annotate(annotate(svc("vip-wins", 2, &[80]), METALLB_POOL[0], "manual"), ANNOTATION_POOL, "auto"),
            annotate(svc("full", 3, &[80]), METALLB_POOL[0], "manual"),
            annotate(svc("missing", 4, &[80]), METALLB_POOL[0], "gold"),
            annotate(annotate(svc("wrong-pool", 5, &[80]), METALLB_POOL[0], "manual"), METALLB_ADDRESSES[0], "198.18.1.11"),
            // A held address outside the named pool is not kept: it moves to that pool.
            annotate(with_ip(svc("moves", 6, &[80]), "198.18.1.10"), ANNOTATION_POOL, "manual"),
        ];
        let d = allocate(&pools, &svcs[..6], &BTreeMap::new());
        assert_eq!(
            alloc(&d),
            [
                ("default/named".into(), "198.18.1.20".into()),
                ("default/old-form".into(), "198.18.1.21".into()),
                ("default/vip-wins".into(), "198.18.1.10".into()),
            ]
        );
        let p = pending(&d);
        assert_eq!(
            p.iter().map(|(s, w)| format!("{s}: {w}")).collect::<Vec<_>>(),
            [
                "default/full: VipPool \"manual\" (metallb.io/address-pool) has no free address",
                "default/missing: no valid VipPool named \"gold\" (metallb.io/address-pool)",
                "default/wrong-pool: requested address 198.18.1.11 is in VipPool \"auto\", not in \"manual\" (metallb.io/address-pool)",
            ]
        );
        let d = allocate(&pools, &svcs[6..], &BTreeMap::new());
        assert!(d.contains(&Decision::Allocate { service: "default/moves".into(), addr: "198.18.1.20".parse().unwrap(), pool: "manual".into() }), "{d:?}");
        assert!(matches!(&d[0], Decision::Release { addr, .. } if addr.to_string() == "198.18.1.10"), "{d:?}");
        assert_eq!(metallb_note(&svcs[2]).unwrap(), "MetalLB annotations: metallb.io/address-pool is ignored: vip.dev/pool is set too and wins");
    }

    #[test]
    fn metallb_allow_shared_ip_shares_like_the_sharing_key() {
        let pools = [pool("a", 10, 2, true)];
        let svcs = [
            annotate(with_ip(svc("web", 0, &[80]), "198.18.1.11"), METALLB_SHARING_KEY[0], "front"),
            annotate(with_ip(svc("tls", 1, &[443]), "198.18.1.11"), METALLB_SHARING_KEY[1], "front"),
            annotate(svc("quic", 2, &[8443]), METALLB_SHARING_KEY[0], "front"),
            annotate(svc("other-key", 3, &[9000]), METALLB_SHARING_KEY[0], "back"),
        ];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        // web and tls keep their shared address, quic joins them, other-key gets its own.
        assert_eq!(alloc(&d), [("default/quic".into(), "198.18.1.11".into()), ("default/other-key".into(), "198.18.1.10".into())], "{d:?}");
        assert_eq!(d.len(), 2, "nothing released: {d:?}");
        assert_eq!(metallb_note(&svcs[1]).unwrap(), "MetalLB annotations: metallb.universe.tf/allow-shared-ip is honoured: use vip.dev/sharing-key instead");
    }

    /// What switching from MetalLB looks like to the allocator: Services already
    /// hold addresses MetalLB gave them (not the lowest, some shared, some in a pool
    /// without autoAssign, some asked for by MetalLB's annotations); none moves, and
    /// a new Service gets a free one.
    #[test]
    fn addresses_another_implementation_gave_are_kept() {
        let pools = [pool("a", 10, 4, true), pool("manual", 20, 2, false)];
        let svcs = [
            with_ip(svc("high", 0, &[80]), "198.18.1.13"),
            annotate(with_ip(svc("asked", 1, &[80]), "198.18.1.12"), METALLB_ADDRESSES[0], "198.18.1.12"),
            annotate(with_ip(svc("pinned", 2, &[80]), "198.18.1.21"), METALLB_POOL[1], "manual"),
            with_ip(svc("no-auto", 3, &[80]), "198.18.1.20"),
            annotate(with_ip(svc("s1", 4, &[80]), "198.18.1.10"), METALLB_SHARING_KEY[0], "k"),
            annotate(with_ip(svc("s2", 5, &[443]), "198.18.1.10"), METALLB_SHARING_KEY[0], "k"),
            svc("new", 6, &[80]),
        ];
        let d = allocate(&pools, &svcs, &BTreeMap::new());
        assert_eq!(d, [Decision::Allocate { service: "default/new".into(), addr: "198.18.1.11".parse().unwrap(), pool: "a".into() }]);
        // The same after a restart, whatever order the watch lists them in.
        let mut shuffled = svcs.to_vec();
        shuffled.reverse();
        shuffled.swap(1, 4);
        assert_eq!(allocate(&pools, &shuffled, &BTreeMap::new()), d);
    }

    #[test]
    fn usage_counts() {
        let pools = [pool("a", 10, 3, true)];
        let u = pool_usage(&pools, &[with_ip(svc("x", 0, &[80]), "198.18.1.11")]);
        assert_eq!(u["a"], (1, 2));
    }
}
