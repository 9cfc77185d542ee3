//! One IPAddressPool and the advertisements that select it as a VipPool: the
//! addresses MetalLB hands out, its selectors, nodes and interfaces.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::{
    read::{Advert, Notes, Pool},
    selectors::{as_labels, describe, matches_everything, one_of, OneOf},
    Warning,
};
use crate::{
    k8s::crd::{validate, VipPool, VipPoolSpec},
    model::{AnnounceMode, Distribution},
    spec,
};

/// The VipPool of one IPAddressPool.
pub(super) fn vip_pool(p: &Pool, adverts: &[Advert], warnings: &mut Vec<Warning>) -> Option<VipPool> {
    let mut n = Notes { object: p.id.clone(), out: warnings };
    if p.addresses.is_empty() {
        n.warn("spec.addresses", "not imported: no address; no VipPool written");
        return None;
    }
    if let Some(prio) = p.priority {
        n.warn(
            "spec.serviceAllocation.priority",
            format!(
                "{prio}: no equivalent: vip offers a Service the pools with autoAssign oldest first, then by name (the pools are written in priority order); \
                 name a pool with vip.dev/pool where it matters"
            ),
        );
    }
    let mut spec = VipPoolSpec {
        addresses: p.addresses.clone(),
        excluded_ips: Vec::new(),
        include_network_and_broadcast: false,
        auto_assign: p.auto_assign,
        service_selector: None,
        namespace_selector: None,
        node_selector: BTreeMap::new(),
        tolerations: Vec::new(),
        announce: AnnounceMode::Arp,
        distribution: Distribution::One,
        table_size: None,
        health_check: None,
        no_healthy_backend: Default::default(),
        gratuitous_arp: None,
        interfaces: Vec::new(),
        vlan: None,
    };
    // The addresses MetalLB hands out: every address of every entry (network and
    // broadcast included), less those ending in .0 or .255 with avoidBuggyIPs.
    let all = match spec::pool_addresses_from_strings("spec", &spec.addresses, &[]) {
        Ok(a) => a,
        Err(e) => {
            n.warn(e.path, format!("not imported: {}; no VipPool written", e.message));
            return None;
        }
    };
    // IPv6 entries hand out every address as written (their CIDRs are ranges here,
    // first address included); avoidBuggyIPs is about IPv4's .0 and .255 only.
    let want: BTreeSet<Ipv4Addr> = all.v4().filter(|a| !p.avoid_buggy_ips || !matches!(a.octets()[3], 0 | 255)).collect();
    if want.is_empty() && all.len_of(crate::addrs::Family::V6) == 0 {
        n.warn("spec.avoidBuggyIPs", "not imported: no address left once those ending in .0 and .255 are avoided; no VipPool written");
        return None;
    }
    let skipping = validate(&spec, 80).map(|v| v.addresses.v4().collect::<BTreeSet<_>>()).unwrap_or_default();
    let has = if want.is_subset(&skipping) {
        skipping
    } else {
        spec.include_network_and_broadcast = true;
        all.v4().collect()
    };
    spec.excluded_ips = has.difference(&want).map(ToString::to_string).collect();

    let ns = one_of(&p.namespaces);
    warn_dropped(&mut n, &ns, "a namespace matching any of namespaces and namespaceSelectors", "namespaceSelector", "namespaces");
    spec.namespace_selector = ns.selector;
    let svc = one_of(&p.services);
    warn_dropped(&mut n, &svc, "a Service matching any of serviceSelectors", "serviceSelector", "Services");
    spec.service_selector = svc.selector;

    let l2: Vec<&Advert> = adverts.iter().filter(|a| !a.bgp && a.selects(p)).collect();
    let bgp: Vec<&Advert> = adverts.iter().filter(|a| a.bgp && a.selects(p)).collect();
    let announcers = match (l2.is_empty(), bgp.is_empty()) {
        (false, _) => l2,
        (true, false) => {
            // MetalLB's BGP mode announces from every selected node (ECMP).
            spec.announce = AnnounceMode::Lo;
            spec.distribution = Distribution::All;
            bgp
        }
        (true, true) => {
            n.warn(
                "",
                "no L2Advertisement or BGPAdvertisement selects it: MetalLB announced none of its addresses; written with `announce: lo` \
                 (the node holding a VIP adds it to lo, nothing answers ARP for it)",
            );
            spec.announce = AnnounceMode::Lo;
            Vec::new()
        }
    };
    spec.node_selector = node_selector(p, &announcers, n.out);
    spec.interfaces = interfaces(p, &announcers, n.out);
    let pool = VipPool::new(&p.name, spec);
    if let Err(e) = validate(&pool.spec, 80) {
        warnings.push(Warning { object: p.id.clone(), field: e.path, message: format!("not imported: {}; no VipPool written", e.message) });
        return None;
    }
    Some(pool)
}

/// Warns about the alternatives of a MetalLB selector list left out of the
/// VipPool's one selector.
fn warn_dropped(n: &mut Notes, one: &OneOf, metallb: &str, field: &str, what: &str) {
    let Some(kept) = &one.kept else { return };
    for d in &one.dropped {
        n.warn(
            d.clone(),
            format!(
                "not imported: MetalLB admits {metallb}, a VipPool takes one {field}: the pool admits only {what} matching {kept} \
                 (give them all a common label and select it)"
            ),
        );
    }
}

/// A VipPool's nodeSelector (labels, all required) for the node selectors of the
/// advertisements that announce `p` (MetalLB: a node matching any of them).
fn node_selector(p: &Pool, adverts: &[&Advert], warnings: &mut Vec<Warning>) -> BTreeMap<String, String> {
    if adverts.is_empty() || adverts.iter().any(|a| a.nodes.is_empty()) {
        return BTreeMap::new();
    }
    // (advertisement, field, selector), each selector once.
    let mut alts: Vec<(&str, &str, &LabelSelector)> = Vec::new();
    for a in adverts {
        for (path, s) in &a.nodes {
            if !alts.iter().any(|x| x.2 == s) {
                alts.push((&a.id, path, s));
            }
        }
    }
    if alts.iter().any(|a| matches_everything(a.2)) {
        return BTreeMap::new();
    }
    if let [(_, _, one)] = alts.as_slice() {
        if let Some(labels) = as_labels(one) {
            return labels;
        }
    }
    let mut warn = |(object, field, _): &(&str, &str, &LabelSelector), message: String| {
        warnings.push(Warning { object: object.to_string(), field: field.to_string(), message });
    };
    // MetalLB's nodes cannot be written as one set of labels: the first alternative
    // that can (a subset of MetalLB's nodes: no node that did not announce the pool
    // holds its VIPs), else every node.
    match alts.iter().enumerate().find_map(|(k, a)| as_labels(a.2).map(|l| (k, l))) {
        Some((kept, labels)) => {
            let shown = labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",");
            for (_, d) in alts.iter().enumerate().filter(|(k, _)| *k != kept) {
                warn(
                    d,
                    format!(
                        "not imported into VipPool {:?}: a VipPool's nodeSelector is one set of labels, MetalLB announces from a node matching any \
                         selector; only nodes labelled {shown} hold its VIPs (give all these nodes a common label and set spec.nodeSelector)",
                        p.name
                    ),
                );
            }
            labels
        }
        None => {
            for d in &alts {
                warn(
                    d,
                    format!(
                        "not imported into VipPool {:?}: {} has no equivalent in a VipPool's nodeSelector (labels only); any eligible node may hold \
                         its VIPs (give the nodes a common label and set spec.nodeSelector)",
                        p.name,
                        describe(d.2)
                    ),
                );
            }
            BTreeMap::new()
        }
    }
}

/// A VipPool's interfaces for the advertisements that announce `p`: all of theirs
/// (MetalLB answers on each; vip on the first a node has), none when one of them
/// names none (MetalLB: every interface).
fn interfaces(p: &Pool, adverts: &[&Advert], warnings: &mut Vec<Warning>) -> Vec<String> {
    if adverts.is_empty() || adverts.iter().any(|a| a.interfaces.is_empty()) {
        return Vec::new();
    }
    let mut out: Vec<String> = Vec::new();
    for a in adverts {
        for (path, name) in &a.interfaces {
            if out.contains(name) {
                continue;
            }
            if let Err(e) = spec::interface_names(path, std::slice::from_ref(name)) {
                warnings.push(Warning { object: a.id.clone(), field: path.clone(), message: format!("not imported: {}", e.message) });
            } else if out.len() == 16 {
                warnings.push(Warning { object: a.id.clone(), field: path.clone(), message: "not imported: a VipPool lists at most 16 interfaces".into() });
            } else {
                out.push(name.clone());
            }
        }
    }
    if out.len() > 1 {
        warnings.push(Warning {
            object: p.id.clone(),
            field: String::new(),
            message: format!(
                "interfaces [{}] (its L2Advertisements'): each node answers for the pool on the first of them it has, MetalLB answered on each",
                out.join(", ")
            ),
        });
    }
    out
}
