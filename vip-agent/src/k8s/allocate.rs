//! IP allocation for Services of type LoadBalancer, computed from the API objects
//! alone (the addresses already in Services' `status.loadBalancer.ingress` are the
//! truth), so a new leader or a restarted agent continues without double
//! allocation. Pure: the elected controller applies the decisions it returns.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::{api::core::v1::Service, apimachinery::pkg::apis::meta::v1::LabelSelector};

use crate::addrs::{AddrSet, Family};

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
    /// IPv4 and IPv6 addresses, as ranges.
    pub addresses: AddrSet,
    pub auto_assign: bool,
    pub service_selector: Option<LabelSelector>,
    pub namespace_selector: Option<LabelSelector>,
}

/// What should change on one Service. The decisions that write a Service's status
/// (`Allocate`, `Release`) carry the whole `ingress` list the Service ends with
/// after all of this pass's decisions about it: the first one writes it, the others
/// only say what changed (one status write per Service and pass).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Write `ingress` to `status.loadBalancer.ingress`: `addr` (from `pool`) is new.
    Allocate { service: String, addr: IpAddr, pool: String, ingress: Vec<IpAddr> },
    /// Write `ingress`: `addr` is no longer the Service's (type or class changed,
    /// pool gone).
    Release { service: String, addr: IpAddr, why: String, ingress: Vec<IpAddr> },
    /// Cannot allocate now; reported as an event and retried on the next change.
    Pending { service: String, why: String },
    /// The Service keeps `addr` although the selectors of its pool no longer admit
    /// it: an edited pool does not take the address of a running Service (its
    /// configuration goes stale rather than broken). Reported, nothing written.
    Stale { service: String, addr: IpAddr, pool: String, why: String },
}

impl Decision {
    pub fn service(&self) -> &str {
        match self {
            Decision::Allocate { service, .. } | Decision::Release { service, .. } | Decision::Pending { service, .. } | Decision::Stale { service, .. } => {
                service
            }
        }
    }
}

/// A Service's `spec.ipFamilyPolicy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FamilyPolicy {
    SingleStack,
    PreferDualStack,
    RequireDualStack,
}

/// The address families a Service gets load-balancer addresses of: those of its
/// `spec.ipFamilies` (the API server sets it on every Service: the first is the
/// Service's primary family), the first only when SingleStack. kube-proxy serves
/// a load-balancer address only for a family the Service has, so no other family
/// is handed out. `need`: how many of them must be had (RequireDualStack: all).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Families {
    pub order: Vec<Family>,
    pub policy: FamilyPolicy,
    /// Whether `spec.ipFamilies` was set; without it (an object no API server
    /// defaulted), one address of whichever family a pool has, IPv4 first.
    pub explicit: bool,
}

impl Families {
    pub fn of(s: &Service) -> Self {
        let spec = s.spec.as_ref();
        let policy = match spec.and_then(|p| p.ip_family_policy.as_deref()) {
            Some("PreferDualStack") => FamilyPolicy::PreferDualStack,
            Some("RequireDualStack") => FamilyPolicy::RequireDualStack,
            _ => FamilyPolicy::SingleStack,
        };
        let mut order: Vec<Family> = Vec::new();
        for f in spec.and_then(|p| p.ip_families.as_ref()).into_iter().flatten().filter_map(|f| Family::from_name(f)) {
            if !order.contains(&f) {
                order.push(f);
            }
        }
        let explicit = !order.is_empty();
        if !explicit {
            order = vec![Family::V4, Family::V6];
        } else if policy == FamilyPolicy::SingleStack {
            order.truncate(1);
        }
        Families { order, policy, explicit }
    }

    /// At most this many addresses.
    fn max(&self) -> usize {
        if self.explicit {
            self.order.len()
        } else {
            1
        }
    }

    fn names(&self) -> String {
        self.order.iter().map(|f| f.name()).collect::<Vec<_>>().join(", ")
    }
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

pub(super) fn ingress_ips(s: &Service) -> Vec<IpAddr> {
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

/// The addresses the Service asks for, if any (at most one per family):
/// `vip.dev/address`, else MetalLB's `loadBalancerIPs` (both comma-separated),
/// else `spec.loadBalancerIP`. Errors name where the request comes from.
pub fn requested(s: &Service) -> Option<Result<Vec<IpAddr>, String>> {
    match annotation(s, ANNOTATION_ADDRESS) {
        Some((name, raw)) => Some(address_list(name, raw)),
        None => {
            let raw = s.spec.as_ref().and_then(|p| p.load_balancer_ip.clone()).filter(|x| !x.is_empty())?;
            Some(raw.parse().map(|a| vec![a]).map_err(|_| format!("spec.loadBalancerIP: {raw:?} is not an IP address")))
        }
    }
}

/// A comma-separated list of at most one address per family; errors name the annotation.
fn address_list(name: &str, raw: &str) -> Result<Vec<IpAddr>, String> {
    let mut out: Vec<IpAddr> = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let ip: IpAddr = part.parse().map_err(|_| format!("{name}: {part:?} is not an IP address"))?;
        if out.iter().any(|a| a.is_ipv4() == ip.is_ipv4()) {
            return Err(format!("{name}: {raw:?} names more than one address of a family (one IPv4 and one IPv6 at most)"));
        }
        out.push(ip);
    }
    if out.is_empty() {
        return Err(format!("{name} names no address"));
    }
    Ok(out)
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
            said.push(if used == m { format!("{m} is honoured: use {own} instead") } else { format!("{m} is ignored: {used} is set too and wins") });
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
type Usage = BTreeMap<IpAddr, Vec<(String, Option<String>, BTreeSet<(String, i32)>)>>;

fn can_share(usage: &Usage, addr: IpAddr, me: &str, key: Option<&str>, my_ports: &BTreeSet<(String, i32)>) -> bool {
    usage
        .get(&addr)
        .is_none_or(|users| users.iter().filter(|(svc, _, _)| svc != me).all(|(_, k, p)| key.is_some() && k.as_deref() == key && p.is_disjoint(my_ports)))
}

/// One family of one of our Services, between the two passes of `allocate`.
struct Slot {
    family: Family,
    /// The address of this family the Service asks for, or why its request is bad.
    request: Option<Result<IpAddr, String>>,
    /// The held address it keeps.
    keep: Option<IpAddr>,
}

/// One of our Services, between the two passes of `allocate`.
struct Plan<'a> {
    s: &'a Service,
    me: String,
    fam: Families,
    share: Option<&'a str>,
    my_ports: BTreeSet<(String, i32)>,
    held: Vec<IpAddr>,
    /// Held addresses in no pool, with why they go.
    released: Vec<(IpAddr, String)>,
    slots: Vec<Slot>,
    stale: Vec<Decision>,
}

/// Decides allocations for every Service. Services are taken in a fixed order
/// (those holding an address first, then by creation time and name), so the result
/// does not depend on the order of the input or on which agent computes it. Each
/// family of a Service (`Families`) is decided on its own: a held address that
/// still fits, else the requested one, else the lowest free one of the first pool
/// that admits the Service and has one of that family. Every kept address is
/// taken before any Service is given a new one: a Service whose address went (its
/// pool was deleted) or that lacks a family must not take the address a Service
/// later in the order still holds.
pub fn allocate(pools: &[PoolView], services: &[Service], ns_labels: &BTreeMap<String, BTreeMap<String, String>>) -> Vec<Decision> {
    let pool_of = |a: IpAddr| pools.iter().find(|p| p.addresses.contains(a));
    let mut order: Vec<&Service> = services.iter().collect();
    order.sort_by_key(|s| (ingress_ips(s).is_empty(), s.metadata.creation_timestamp.as_ref().map(|t| t.0), key(s)));
    let mut usage: Usage = BTreeMap::new();
    let mut out = Vec::new();
    let mut plans: Vec<Plan> = Vec::new();
    // First pass: the held addresses kept.
    for s in order {
        let me = key(s);
        let held: Vec<IpAddr> = ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_some()).collect();
        if !is_ours(s) {
            for a in held {
                out.push(Decision::Release { service: me.clone(), addr: a, why: why_not_ours(s), ingress: Vec::new() });
            }
            continue;
        }
        let my_ports = ports(s);
        let share = sharing_key(s);
        // Our Services' statuses are ours: an address in no pool (its pool was
        // deleted or narrowed) is served by nobody and goes.
        let released: Vec<(IpAddr, String)> =
            ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_none()).map(|a| (a, "the address is in no VipPool".to_owned())).collect();
        let fam = Families::of(s);
        let want_pool = requested_pool(s);
        let in_wanted_pool = |a: IpAddr| want_pool.is_none_or(|(_, name)| pool_of(a).is_some_and(|p| p.name == name));
        // The requested addresses, each of a family the Service has.
        let want: Option<Result<Vec<IpAddr>, String>> = requested(s).map(|r| {
            r.and_then(|addrs| match addrs.iter().find(|a| !fam.order.contains(&Family::of(**a))) {
                Some(a) => Err(format!("requested address {a} is {}, not of the Service's families (spec.ipFamilies: {})", Family::of(*a), fam.names())),
                None if fam.explicit && addrs.len() > fam.max() => {
                    Err(format!("{} addresses are requested, but the Service is SingleStack (spec.ipFamilyPolicy): ask for one", addrs.len()))
                }
                None => Ok(addrs),
            })
        });
        let mut slots = Vec::new();
        let mut stale = Vec::new();
        for f in fam.order.iter().copied() {
            if slots.iter().filter(|x: &&Slot| x.keep.is_some()).count() >= fam.max() {
                break;
            }
            let request: Option<Result<IpAddr, String>> = match &want {
                None => None,
                Some(Err(e)) => Some(Err(e.clone())),
                // With a request, the families it names are the ones served.
                Some(Ok(addrs)) => match addrs.iter().find(|a| Family::of(**a) == f) {
                    Some(a) => Some(Ok(*a)),
                    None if fam.policy == FamilyPolicy::RequireDualStack => Some(Err(format!("RequireDualStack: the requested addresses name no {f} address"))),
                    None => continue,
                },
            };
            // Keep a held address that still fits (requested one, in the requested
            // pool, not taken): an address another implementation (MetalLB) gave
            // the Service stays too, so switching to vip changes no Service's
            // address. One its pool's selectors no longer admit (the pool, the
            // Service's labels or its namespace's changed) is kept too, and
            // reported: a running Service does not lose its address to an edit
            // elsewhere.
            let keep = held.iter().copied().filter(|a| Family::of(*a) == f).find(|a| {
                let fits_request = match &request {
                    Some(Ok(r)) => r == a,
                    Some(Err(_)) => false,
                    None => true,
                };
                fits_request && in_wanted_pool(*a) && can_share(&usage, *a, &me, share, &my_ports)
            });
            if let Some(addr) = keep {
                if let Some(p) = pool_of(addr).filter(|p| !pool_admits(p, s, ns_labels)) {
                    let why = format!(
                        "{addr} kept although the selectors of VipPool {:?} no longer admit this Service; recreate it or ask for another address ({ANNOTATION_ADDRESS}) to move it",
                        p.name
                    );
                    stale.push(Decision::Stale { service: me.clone(), addr, pool: p.name.clone(), why });
                }
                usage.entry(addr).or_default().push((me.clone(), share.map(str::to_owned), my_ports.clone()));
            }
            slots.push(Slot { family: f, request, keep });
        }
        plans.push(Plan { s, me, fam, share, my_ports, held, released, slots, stale });
    }
    // Second pass: the families without a kept address, in the same order.
    for Plan { s, me, fam, share, my_ports, held, mut released, slots, stale } in plans {
        let kept = slots.iter().filter(|x| x.keep.is_some()).count();
        let mut chosen: Vec<(IpAddr, Option<String>)> = Vec::new();
        let mut failed: Vec<String> = Vec::new();
        for slot in slots {
            if let Some(a) = slot.keep {
                chosen.push((a, None));
                continue;
            }
            if kept + chosen.iter().filter(|(_, p)| p.is_some()).count() >= fam.max() {
                continue;
            }
            match new_address(pools, slot, &fam, s, ns_labels, &usage, &me, share, &my_ports) {
                Ok(x) => chosen.push(x),
                Err(e) => failed.push(e),
            }
        }
        failed.dedup();
        let enough = match fam.policy {
            FamilyPolicy::RequireDualStack if fam.explicit => failed.is_empty() && chosen.len() == fam.order.len(),
            _ => !chosen.is_empty(),
        };
        let mut pending = None;
        if !enough {
            // Never half an answer: nothing new is written; held addresses that
            // still fit are kept (a change elsewhere may complete the pair).
            let why = match fam.policy {
                FamilyPolicy::RequireDualStack if fam.explicit => {
                    format!("RequireDualStack needs an address of each family ({}), none allocated until both can be: {}", fam.names(), failed.join("; "))
                }
                _ => failed.first().cloned().unwrap_or_else(|| "no address family to allocate".into()),
            };
            chosen.retain(|(_, pool)| pool.is_none());
            pending = Some(Decision::Pending { service: me.clone(), why });
        }
        out.extend(stale);
        let ingress: Vec<IpAddr> = chosen.iter().map(|(a, _)| *a).collect();
        released.extend(held.iter().filter(|a| !ingress.contains(a)).map(|a| (*a, "the address no longer fits the Service or its pool".to_owned())));
        for (addr, why) in released {
            out.push(Decision::Release { service: me.clone(), addr, why, ingress: ingress.clone() });
        }
        for (a, pool) in chosen {
            // Kept addresses are in `usage` already.
            if let Some(pool) = pool {
                usage.entry(a).or_default().push((me.clone(), share.map(str::to_owned), my_ports.clone()));
                out.push(Decision::Allocate { service: me.clone(), addr: a, pool, ingress: ingress.clone() });
            }
        }
        out.extend(pending);
    }
    out
}

/// The new address a family of a Service gets (with its pool): the requested one
/// if it is free for it, else a free one (`free_address`); or why none.
#[allow(clippy::too_many_arguments)]
fn new_address(
    pools: &[PoolView],
    slot: Slot,
    fam: &Families,
    s: &Service,
    ns_labels: &BTreeMap<String, BTreeMap<String, String>>,
    usage: &Usage,
    me: &str,
    share: Option<&str>,
    my_ports: &BTreeSet<(String, i32)>,
) -> Result<(IpAddr, Option<String>), String> {
    let r = match slot.request {
        None => return free_address(pools, slot.family, fam, s, ns_labels, usage, me, share, my_ports),
        Some(r) => r?,
    };
    let want_pool = requested_pool(s);
    match pools.iter().find(|p| p.addresses.contains(r)) {
        None => Err(format!("requested address {r} is in no VipPool")),
        Some(p) if want_pool.is_some_and(|(_, name)| p.name != name) => {
            let (ann, name) = want_pool.expect("a requested pool");
            Err(format!("requested address {r} is in VipPool {:?}, not in {name:?} ({ann})", p.name))
        }
        Some(p) if !pool_admits(p, s, ns_labels) => Err(format!("requested address {r} is in pool {:?}, whose selectors do not admit this Service", p.name)),
        Some(_) if !can_share(usage, r, me, share, my_ports) => {
            Err(format!("requested address {r} is in use by another Service (share it with a common {ANNOTATION_SHARING_KEY} and distinct ports)"))
        }
        Some(p) => Ok((r, Some(p.name.clone()))),
    }
}

/// The address of family `f` a Service that asks for none gets: a shareable one
/// already used with its sharing key, else the lowest free one, from the pool it
/// names, else from the first pool with autoAssign that admits it and has one.
#[allow(clippy::too_many_arguments)]
fn free_address(
    pools: &[PoolView],
    f: Family,
    fam: &Families,
    s: &Service,
    ns_labels: &BTreeMap<String, BTreeMap<String, String>>,
    usage: &Usage,
    me: &str,
    share: Option<&str>,
    my_ports: &BTreeSet<(String, i32)>,
) -> Result<(IpAddr, Option<String>), String> {
    let want_pool = requested_pool(s);
    // A named pool is used whatever its autoAssign (as MetalLB does).
    let candidates: Vec<&PoolView> = match want_pool {
        Some((_, name)) => pools.iter().filter(|p| p.name == name).collect(),
        None => pools.iter().filter(|p| p.auto_assign).collect(),
    };
    let used: BTreeSet<IpAddr> = usage.keys().copied().collect();
    for p in candidates.iter().copied().filter(|p| pool_admits(p, s, ns_labels)) {
        let shared =
            share.and_then(|_| usage.keys().copied().find(|a| Family::of(*a) == f && p.addresses.contains(*a) && can_share(usage, *a, me, share, my_ports)));
        if let Some(a) = shared.or_else(|| p.addresses.first_free(f, &used)) {
            return Ok((a, Some(p.name.clone())));
        }
    }
    // Name the family only where the Service asked for one.
    let an = if fam.explicit { format!("a free {f} address") } else { "a free address".into() };
    Err(match (want_pool, candidates.first()) {
        (None, _) => format!("no VipPool with autoAssign admits this Service and has {an}"),
        (Some((ann, name)), None) => format!("no valid VipPool named {name:?} ({ann})"),
        (Some((ann, name)), Some(p)) if !pool_admits(p, s, ns_labels) => format!("VipPool {name:?} ({ann}) does not admit this Service (its selectors)"),
        (Some((ann, name)), Some(_)) => format!("VipPool {name:?} ({ann}) has no {}", &an[2..]),
    })
}

/// (allocated, free) addresses of each pool, from the Services' statuses (a count
/// beyond u32, an IPv6 prefix's, is u32::MAX).
pub fn pool_usage(pools: &[PoolView], services: &[Service]) -> BTreeMap<String, (u32, u32)> {
    let used: BTreeSet<IpAddr> = services.iter().filter(|s| is_ours(s)).flat_map(ingress_ips).collect();
    pools
        .iter()
        .map(|p| {
            let n = used.iter().filter(|a| p.addresses.contains(**a)).count() as u128;
            (p.name.clone(), (saturated(n), saturated(p.addresses.len() - n)))
        })
        .collect()
}

/// A count as the pool status's u32 fields take it.
pub fn saturated(n: u128) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{LoadBalancerIngress, LoadBalancerStatus, ServicePort, ServiceSpec, ServiceStatus},
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };

    use super::*;

    fn set(ranges: &[(&str, &str)]) -> AddrSet {
        let mut s = AddrSet::default();
        for (a, b) in ranges {
            s.insert_range(a.parse().unwrap(), b.parse().unwrap());
        }
        s
    }

    fn pool(name: &str, first: u8, n: u8, auto: bool) -> PoolView {
        PoolView {
            name: name.into(),
            addresses: set(&[(&format!("198.18.1.{first}"), &format!("198.18.1.{}", first + n - 1))]),
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
        // Nor is one of a family: "early" holds its IPv4 address and lacks its IPv6
        // one, "late" holds the IPv6 pool's lowest.
        let v6 = PoolView { addresses: set(&[("2001:2::1", "2001:2::2")]), ..pool("v6", 0, 1, true) };
        let dual = |s| families(s, "RequireDualStack", &["IPv4", "IPv6"]);
        let svcs = [dual(with_ip(svc("early", 0, &[80]), "198.18.1.30")), families(with_ip(svc("late", 1, &[80]), "2001:2::1"), "SingleStack", &["IPv6"])];
        let d = allocate(&[pools[0].clone(), v6], &svcs, &BTreeMap::new());
        assert_eq!(alloc(&d), [("default/early".into(), "2001:2::2".into())], "{d:?}");
        assert!(!d.iter().any(|x| matches!(x, Decision::Release { .. })), "{d:?}");
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
    fn metallb_load_balancer_ips_are_honoured_vip_wins() {
        let pools = [pool("a", 10, 5, true)];
        let svcs = [
            annotate(svc("new-form", 0, &[80]), METALLB_ADDRESSES[0], "198.18.1.12"),
            annotate(svc("old-form", 1, &[80]), METALLB_ADDRESSES[1], "198.18.1.13"),
            annotate(svc("dual", 2, &[80]), METALLB_ADDRESSES[0], "2001:2::5, 198.18.1.14"),
            annotate(annotate(svc("both", 3, &[80]), METALLB_ADDRESSES[0], "198.18.1.10"), ANNOTATION_ADDRESS, "198.18.1.11"),
            annotate(svc("v6-only", 4, &[80]), METALLB_ADDRESSES[0], "2001:2::6"),
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
        assert_eq!(p[0].1, "requested address 2001:2::6 is in no VipPool");
        assert!(p[1].1.contains("more than one address of a family"), "{}", p[1].1);
        assert_eq!(p[2].1, "metallb.universe.tf/loadBalancerIPs: \"198.18.1.x\" is not an IP address");
        // The Warnings' notes: honoured or overridden.
        assert_eq!(metallb_note(&svcs[0]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead");
        assert_eq!(metallb_note(&svcs[2]).unwrap(), "MetalLB annotations: metallb.io/loadBalancerIPs is honoured: use vip.dev/address instead");
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
        assert!(
            d.contains(&Decision::Allocate {
                service: "default/moves".into(),
                addr: "198.18.1.20".parse().unwrap(),
                pool: "manual".into(),
                ingress: vec!["198.18.1.20".parse().unwrap()]
            }),
            "{d:?}"
        );
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
        assert_eq!(
            d,
            [Decision::Allocate {
                service: "default/new".into(),
                addr: "198.18.1.11".parse().unwrap(),
                pool: "a".into(),
                ingress: vec!["198.18.1.11".parse().unwrap()]
            }]
        );
        // The same after a restart, whatever order the watch lists them in.
        let mut shuffled = svcs.to_vec();
        shuffled.reverse();
        shuffled.swap(1, 4);
        assert_eq!(allocate(&pools, &shuffled, &BTreeMap::new()), d);
    }

    fn families(mut s: Service, policy: &str, fams: &[&str]) -> Service {
        let spec = s.spec.as_mut().unwrap();
        spec.ip_family_policy = Some(policy.into());
        spec.ip_families = Some(fams.iter().map(|f| f.to_string()).collect());
        s
    }

    fn v6_pool(name: &str, auto: bool) -> PoolView {
        // A /64 less its subnet-router anycast address, as `crd::validate` makes it.
        PoolView { addresses: set(&[("2001:2::1", "2001:2::ffff:ffff:ffff:ffff")]), ..pool(name, 0, 1, auto) }
    }

    /// Every family policy against single- and dual-family pools: the addresses
    /// written (in the Service's family order) or why none is.
    #[test]
    fn family_policies_get_one_or_two_addresses_never_half() {
        let v4 = || pool("v4", 10, 2, true);
        let v6 = || v6_pool("v6", true);
        let dual = || PoolView { addresses: set(&[("198.18.1.10", "198.18.1.11"), ("2001:2::1", "2001:2::ffff")]), ..pool("dual", 0, 1, true) };
        type Case<'a> = (&'a str, Vec<PoolView>, &'a str, &'a [&'a str], Result<&'a [&'a str], &'a str>);
        let cases: Vec<Case> = vec![
            ("single v4", vec![dual()], "SingleStack", &["IPv4"], Ok(&["198.18.1.10"])),
            ("single v6", vec![dual()], "SingleStack", &["IPv6"], Ok(&["2001:2::1"])),
            ("single v6, v4 pool only", vec![v4()], "SingleStack", &["IPv6"], Err("no VipPool with autoAssign admits this Service and has a free IPv6 address")),
            ("prefer, dual pool", vec![dual()], "PreferDualStack", &["IPv6", "IPv4"], Ok(&["2001:2::1", "198.18.1.10"])),
            ("prefer, two pools", vec![v4(), v6()], "PreferDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10", "2001:2::1"])),
            ("prefer, v4 pool only", vec![v4()], "PreferDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10"])),
            ("prefer on a single-stack cluster", vec![dual()], "PreferDualStack", &["IPv4"], Ok(&["198.18.1.10"])),
            ("require, dual pool", vec![dual()], "RequireDualStack", &["IPv4", "IPv6"], Ok(&["198.18.1.10", "2001:2::1"])),
            (
                "require, v4 pool only",
                vec![v4()],
                "RequireDualStack",
                &["IPv4", "IPv6"],
                Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: no VipPool with autoAssign admits this Service and has a free IPv6 address"),
            ),
        ];
        for (what, pools, policy, fams, want) in cases {
            let d = allocate(&pools, &[families(svc("web", 0, &[80]), policy, fams)], &BTreeMap::new());
            match want {
                Ok(addrs) => {
                    let got: Vec<String> = alloc(&d).into_iter().map(|(_, a)| a).collect();
                    assert_eq!(got, addrs, "{what}: {d:?}");
                    let Decision::Allocate { ingress, .. } = &d[0] else { panic!("{what}: {d:?}") };
                    assert_eq!(ingress.iter().map(|a| a.to_string()).collect::<Vec<_>>(), addrs, "{what}: the status lists each");
                }
                Err(why) => assert_eq!(d, [Decision::Pending { service: "default/web".into(), why: why.into() }], "{what}"),
            }
        }
    }

    #[test]
    fn requests_name_one_address_per_family() {
        let pools = [pool("v4", 10, 3, true), v6_pool("v6", true)];
        let dual = |s| families(s, "RequireDualStack", &["IPv4", "IPv6"]);
        type Case<'a> = (Service, Result<&'a [&'a str], &'a str>);
        let cases: Vec<Case> = vec![
            (dual(annotate(svc("both", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9, 198.18.1.12")), Ok(&["198.18.1.12", "2001:2::9"])),
            (
                dual(annotate(svc("one", 0, &[80]), ANNOTATION_ADDRESS, "198.18.1.12")),
                Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: RequireDualStack: the requested addresses name no IPv6 address"),
            ),
            (families(annotate(svc("prefer", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9"), "PreferDualStack", &["IPv4", "IPv6"]), Ok(&["2001:2::9"])),
            (
                families(annotate(svc("wrong-family", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9"), "SingleStack", &["IPv4"]),
                Err("requested address 2001:2::9 is IPv6, not of the Service's families (spec.ipFamilies: IPv4)"),
            ),
            (
                dual(annotate(svc("two-v6", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::9,2001:2::8")),
                Err("RequireDualStack needs an address of each family (IPv4, IPv6), none allocated until both can be: vip.dev/address: \"2001:2::9,2001:2::8\" names more than one address of a family (one IPv4 and one IPv6 at most)"),
            ),
            (
                families(svc("lbip", 0, &[80]), "SingleStack", &["IPv6"]),
                Ok(&["2001:2::1"]),
            ),
            (
                {
                    let mut s = families(svc("lbip", 0, &[80]), "SingleStack", &["IPv6"]);
                    s.spec.as_mut().unwrap().load_balancer_ip = Some("2001:2::abc".into());
                    s
                },
                Ok(&["2001:2::abc"]),
            ),
            (
                families(annotate(svc("anycast", 0, &[80]), ANNOTATION_ADDRESS, "2001:2::"), "SingleStack", &["IPv6"]),
                Err("requested address 2001:2:: is in no VipPool"),
            ),
        ];
        for (s, want) in cases {
            let d = allocate(&pools, std::slice::from_ref(&s), &BTreeMap::new());
            match want {
                Ok(addrs) => assert_eq!(alloc(&d).into_iter().map(|(_, a)| a).collect::<Vec<_>>(), addrs, "{}: {d:?}", key(&s)),
                Err(why) => assert_eq!(pending(&d), [(key(&s), why.to_owned())], "{}", key(&s)),
            }
        }
    }

    /// A dual-stack Service that holds its IPv4 address gets its IPv6 one added in
    /// one write of both; one that can no longer have both keeps what it holds.
    #[test]
    fn a_held_family_is_kept_and_the_other_added() {
        let pools = [pool("v4", 10, 3, true), v6_pool("v6", true)];
        let s = families(with_ip(svc("web", 0, &[80]), "198.18.1.11"), "RequireDualStack", &["IPv4", "IPv6"]);
        let d = allocate(&pools, std::slice::from_ref(&s), &BTreeMap::new());
        let ingress: Vec<IpAddr> = vec!["198.18.1.11".parse().unwrap(), "2001:2::1".parse().unwrap()];
        assert_eq!(d, [Decision::Allocate { service: "default/web".into(), addr: "2001:2::1".parse().unwrap(), pool: "v6".into(), ingress }]);
        let d = allocate(&pools[..1], &[s], &BTreeMap::new());
        assert!(matches!(&d[..], [Decision::Pending { why, .. }] if why.starts_with("RequireDualStack needs")), "kept, nothing written: {d:?}");
        // A huge pool costs nothing: the next free address of a /64 in use.
        let used: Vec<Service> =
            (0..3).map(|i| with_ip(families(svc(&format!("s{i}"), i, &[80]), "SingleStack", &["IPv6"]), &format!("2001:2::{}", i + 1))).collect();
        let mut all = used.clone();
        all.push(families(svc("new", 9, &[80]), "SingleStack", &["IPv6"]));
        assert_eq!(alloc(&allocate(&pools, &all, &BTreeMap::new())), [("default/new".into(), "2001:2::4".into())]);
        let u = pool_usage(&pools, &used);
        assert_eq!(u["v6"], (3, u32::MAX), "counts beyond u32 saturate");
    }

    #[test]
    fn usage_counts() {
        let pools = [pool("a", 10, 3, true)];
        let u = pool_usage(&pools, &[with_ip(svc("x", 0, &[80]), "198.18.1.11")]);
        assert_eq!(u["a"], (1, 2));
    }
}
