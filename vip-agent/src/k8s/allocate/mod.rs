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

mod error;
pub use error::AllocError;

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
    Pending { service: String, why: AllocError },
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
pub fn requested(s: &Service) -> Option<Result<Vec<IpAddr>, AllocError>> {
    match annotation(s, ANNOTATION_ADDRESS) {
        Some((name, raw)) => Some(address_list(name, raw)),
        None => {
            let raw = s.spec.as_ref().and_then(|p| p.load_balancer_ip.clone()).filter(|x| !x.is_empty())?;
            Some(raw.parse().map(|a| vec![a]).map_err(|_| AllocError::BadLoadBalancerIp(raw)))
        }
    }
}

/// A comma-separated list of at most one address per family; errors name the annotation.
fn address_list(annotation: &'static str, raw: &str) -> Result<Vec<IpAddr>, AllocError> {
    let mut out: Vec<IpAddr> = Vec::new();
    for part in raw.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let ip: IpAddr = part.parse().map_err(|_| AllocError::NotAnAddress { annotation, part: part.to_owned() })?;
        if out.iter().any(|a| a.is_ipv4() == ip.is_ipv4()) {
            return Err(AllocError::TwoOfAFamily { annotation, raw: raw.to_owned() });
        }
        out.push(ip);
    }
    if out.is_empty() {
        return Err(AllocError::NoAddress { annotation });
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

fn pool_admits(p: &PoolView, s: &Service, ns_labels: &NsLabels) -> bool {
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

/// Namespace → its labels (namespace selectors).
type NsLabels = BTreeMap<String, BTreeMap<String, String>>;

/// One of our Services as the allocator weighs it: what every choice for each of
/// its families needs.
struct Asker<'a> {
    s: &'a Service,
    /// `namespace/name`.
    me: String,
    fam: Families,
    share: Option<&'a str>,
    ports: BTreeSet<(String, i32)>,
    ns_labels: &'a NsLabels,
}

impl<'a> Asker<'a> {
    fn new(s: &'a Service, ns_labels: &'a NsLabels) -> Self {
        Asker { s, me: key(s), fam: Families::of(s), share: sharing_key(s), ports: ports(s), ns_labels }
    }

    fn admitted_by(&self, p: &PoolView) -> bool {
        pool_admits(p, self.s, self.ns_labels)
    }

    /// Whether it may use `addr` beside the Services already using it.
    fn may_use(&self, usage: &Usage, addr: IpAddr) -> bool {
        can_share(usage, addr, &self.me, self.share, &self.ports)
    }

    /// Records that it uses `addr`.
    fn take(&self, usage: &mut Usage, addr: IpAddr) {
        usage.entry(addr).or_default().push((self.me.clone(), self.share.map(str::to_owned), self.ports.clone()));
    }

    /// The addresses it asks for, each of a family it has.
    fn wanted(&self) -> Option<Result<Vec<IpAddr>, AllocError>> {
        let fam = &self.fam;
        requested(self.s).map(|r| {
            r.and_then(|addrs| match addrs.iter().find(|a| !fam.order.contains(&Family::of(**a))) {
                Some(a) => Err(AllocError::NotOfFamilies { addr: *a, families: fam.names() }),
                None if fam.explicit && addrs.len() > fam.max() => Err(AllocError::SingleStack(addrs.len())),
                None => Ok(addrs),
            })
        })
    }
}

/// One family of one of our Services, between the two passes of `allocate`.
struct Slot {
    family: Family,
    /// The address of this family the Service asks for, or why its request is bad.
    request: Option<Result<IpAddr, AllocError>>,
    /// The held address it keeps.
    keep: Option<IpAddr>,
}

/// One of our Services, between the two passes of `allocate`.
struct Plan<'a> {
    asker: Asker<'a>,
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
pub fn allocate(pools: &[PoolView], services: &[Service], ns_labels: &NsLabels) -> Vec<Decision> {
    let pool_of = |a: IpAddr| pools.iter().find(|p| p.addresses.contains(a));
    let mut order: Vec<&Service> = services.iter().collect();
    order.sort_by_key(|s| (ingress_ips(s).is_empty(), s.metadata.creation_timestamp.as_ref().map(|t| t.0), key(s)));
    let mut usage: Usage = BTreeMap::new();
    let mut out = Vec::new();
    let mut plans: Vec<Plan> = Vec::new();
    // First pass: the held addresses kept.
    for s in order {
        let held: Vec<IpAddr> = ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_some()).collect();
        if !is_ours(s) {
            for a in held {
                out.push(Decision::Release { service: key(s), addr: a, why: why_not_ours(s), ingress: Vec::new() });
            }
            continue;
        }
        let asker = Asker::new(s, ns_labels);
        let fam = &asker.fam;
        // Our Services' statuses are ours: an address in no pool (its pool was
        // deleted or narrowed) is served by nobody and goes.
        let released: Vec<(IpAddr, String)> =
            ingress_ips(s).into_iter().filter(|a| pool_of(*a).is_none()).map(|a| (a, "the address is in no VipPool".to_owned())).collect();
        let want_pool = requested_pool(s);
        let in_wanted_pool = |a: IpAddr| want_pool.is_none_or(|(_, name)| pool_of(a).is_some_and(|p| p.name == name));
        let want = asker.wanted();
        let mut slots = Vec::new();
        let mut stale = Vec::new();
        for f in fam.order.iter().copied() {
            if slots.iter().filter(|x: &&Slot| x.keep.is_some()).count() >= fam.max() {
                break;
            }
            let request: Option<Result<IpAddr, AllocError>> = match &want {
                None => None,
                Some(Err(e)) => Some(Err(e.clone())),
                // With a request, the families it names are the ones served.
                Some(Ok(addrs)) => match addrs.iter().find(|a| Family::of(**a) == f) {
                    Some(a) => Some(Ok(*a)),
                    None if fam.policy == FamilyPolicy::RequireDualStack => Some(Err(AllocError::RequestLacks(f))),
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
                fits_request && in_wanted_pool(*a) && asker.may_use(&usage, *a)
            });
            if let Some(addr) = keep {
                if let Some(p) = pool_of(addr).filter(|p| !asker.admitted_by(p)) {
                    let why = format!(
                        "{addr} kept although the selectors of VipPool {:?} no longer admit this Service; recreate it or ask for another address ({ANNOTATION_ADDRESS}) to move it",
                        p.name
                    );
                    stale.push(Decision::Stale { service: asker.me.clone(), addr, pool: p.name.clone(), why });
                }
                asker.take(&mut usage, addr);
            }
            slots.push(Slot { family: f, request, keep });
        }
        plans.push(Plan { asker, held, released, slots, stale });
    }
    // Second pass: the families without a kept address, in the same order.
    for Plan { asker, held, mut released, slots, stale } in plans {
        let (fam, me) = (&asker.fam, &asker.me);
        let kept = slots.iter().filter(|x| x.keep.is_some()).count();
        let mut chosen: Vec<(IpAddr, Option<String>)> = Vec::new();
        let mut failed: Vec<AllocError> = Vec::new();
        for slot in slots {
            if let Some(a) = slot.keep {
                chosen.push((a, None));
                continue;
            }
            if kept + chosen.iter().filter(|(_, p)| p.is_some()).count() >= fam.max() {
                continue;
            }
            match new_address(pools, slot, &asker, &usage) {
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
                FamilyPolicy::RequireDualStack if fam.explicit => AllocError::NotBothFamilies { families: fam.names(), causes: failed },
                _ => failed.into_iter().next().unwrap_or(AllocError::NoFamily),
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
                asker.take(&mut usage, a);
                out.push(Decision::Allocate { service: me.clone(), addr: a, pool, ingress: ingress.clone() });
            }
        }
        out.extend(pending);
    }
    out
}

/// The new address a family of a Service gets (with its pool): the requested one
/// if it is free for it, else a free one (`free_address`); or why none.
fn new_address(pools: &[PoolView], slot: Slot, asker: &Asker, usage: &Usage) -> Result<(IpAddr, Option<String>), AllocError> {
    let r = match slot.request {
        None => return free_address(pools, slot.family, asker, usage),
        Some(r) => r?,
    };
    let want_pool = requested_pool(asker.s);
    match pools.iter().find(|p| p.addresses.contains(r)) {
        None => Err(AllocError::InNoPool(r)),
        Some(p) if want_pool.is_some_and(|(_, name)| p.name != name) => {
            let (annotation, wanted) = want_pool.expect("a requested pool");
            Err(AllocError::InOtherPool { addr: r, pool: p.name.clone(), wanted: wanted.to_owned(), annotation })
        }
        Some(p) if !asker.admitted_by(p) => Err(AllocError::NotAdmitted { addr: r, pool: p.name.clone() }),
        Some(_) if !asker.may_use(usage, r) => Err(AllocError::InUse(r)),
        Some(p) => Ok((r, Some(p.name.clone()))),
    }
}

/// The address of family `f` a Service that asks for none gets: a shareable one
/// already used with its sharing key, else the lowest free one, from the pool it
/// names, else from the first pool with autoAssign that admits it and has one.
fn free_address(pools: &[PoolView], f: Family, asker: &Asker, usage: &Usage) -> Result<(IpAddr, Option<String>), AllocError> {
    let want_pool = requested_pool(asker.s);
    // A named pool is used whatever its autoAssign (as MetalLB does).
    let candidates: Vec<&PoolView> = match want_pool {
        Some((_, name)) => pools.iter().filter(|p| p.name == name).collect(),
        None => pools.iter().filter(|p| p.auto_assign).collect(),
    };
    let used: BTreeSet<IpAddr> = usage.keys().copied().collect();
    for p in candidates.iter().copied().filter(|p| asker.admitted_by(p)) {
        let shared = asker.share.and_then(|_| usage.keys().copied().find(|a| Family::of(*a) == f && p.addresses.contains(*a) && asker.may_use(usage, *a)));
        if let Some(a) = shared.or_else(|| p.addresses.first_free(f, &used)) {
            return Ok((a, Some(p.name.clone())));
        }
    }
    // Name the family only where the Service asked for one.
    let family = asker.fam.explicit.then_some(f);
    Err(match (want_pool, candidates.first()) {
        (None, _) => AllocError::NoPoolAdmits { family },
        (Some((annotation, name)), None) => AllocError::NoSuchPool { name: name.to_owned(), annotation },
        (Some((annotation, name)), Some(p)) if !asker.admitted_by(p) => AllocError::PoolRefuses { name: name.to_owned(), annotation },
        (Some((annotation, name)), Some(_)) => AllocError::PoolFull { name: name.to_owned(), annotation, family },
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
mod tests;
