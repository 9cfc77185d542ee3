//! MetalLB's objects as read: each IPAddressPool a [`Pool`], each L2Advertisement
//! and BGPAdvertisement an [`Advert`], with a [`Warning`] for what they hold that
//! is not imported.
use std::{collections::BTreeMap, net::IpAddr};

use ipnet::{IpNet, Ipv6Net};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde_json::Value;

use super::{selectors::normalized, Warning, NAMESPACE_NAME_LABEL};
use crate::k8s::allocate::label_selector_matches;

/// An object's name for warnings: `Kind namespace/name`.
pub(super) fn object_id(kind: &str, v: &Value) -> String {
    let name = v["metadata"]["name"].as_str().unwrap_or("(no name)");
    match v["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Collects the warnings about one object.
pub(super) struct Notes<'a> {
    pub(super) object: String,
    pub(super) out: &'a mut Vec<Warning>,
}

impl Notes<'_> {
    pub(super) fn warn(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.out.push(Warning { object: self.object.clone(), field: field.into(), message: message.into() });
    }

    /// Fields of `spec` (at `path`) not in `known`.
    fn unknown_fields(&mut self, spec: &Value, path: &str, known: &[&str]) {
        for k in spec.as_object().into_iter().flat_map(|m| m.keys()).filter(|k| !known.contains(&k.as_str())) {
            self.warn(format!("{path}.{k}"), "not imported: a field this import does not know");
        }
    }

    /// A list of strings (absent: empty); items of another type are warned about.
    fn strings(&mut self, v: &Value, path: &str) -> Vec<(String, String)> {
        match v {
            Value::Null => Vec::new(),
            Value::Array(items) => items
                .iter()
                .enumerate()
                .filter_map(|(k, x)| match x.as_str() {
                    Some(s) => Some((format!("{path}[{k}]"), s.to_owned())),
                    None => {
                        self.warn(format!("{path}[{k}]"), format!("not imported: {x} is not a string"));
                        None
                    }
                })
                .collect(),
            other => {
                self.warn(path, format!("not imported: {other} is not a list"));
                Vec::new()
            }
        }
    }

    fn boolean(&mut self, v: &Value, path: &str, default: bool) -> bool {
        match v {
            Value::Null => default,
            Value::Bool(b) => *b,
            other => {
                self.warn(path, format!("not imported: {other} is not a boolean; taken as {default}"));
                default
            }
        }
    }

    /// A list of label selectors, with their paths.
    fn selectors(&mut self, v: &Value, path: &str) -> Vec<(String, LabelSelector)> {
        let items = match v {
            Value::Null => return Vec::new(),
            Value::Array(items) => items,
            other => {
                self.warn(path, format!("not imported: {other} is not a list of label selectors"));
                return Vec::new();
            }
        };
        let mut out = Vec::new();
        for (k, x) in items.iter().enumerate() {
            let at = format!("{path}[{k}]");
            let bad_op = x["matchExpressions"]
                .as_array()
                .into_iter()
                .flatten()
                .find_map(|e| e["operator"].as_str().filter(|op| !["In", "NotIn", "Exists", "DoesNotExist"].contains(op)));
            match serde_json::from_value::<LabelSelector>(x.clone()) {
                Ok(_) if bad_op.is_some() => {
                    self.warn(at, format!("not imported: operator {:?} is not one of In, NotIn, Exists, DoesNotExist", bad_op.unwrap()))
                }
                Ok(sel) => out.push((at, normalized(sel))),
                Err(e) => self.warn(at, format!("not imported: not a label selector: {e}")),
            }
        }
        out
    }
}

/// An IPAddressPool, read.
pub(super) struct Pool {
    pub(super) id: String,
    pub(super) name: String,
    pub(super) labels: BTreeMap<String, String>,
    /// Its entries, IPv4 and IPv6, normalised (`a-b`, `net/len` with host bits
    /// cleared; an IPv6 CIDR of more than two addresses as the range of them all).
    pub(super) addresses: Vec<String>,
    pub(super) auto_assign: bool,
    pub(super) avoid_buggy_ips: bool,
    pub(super) priority: Option<i64>,
    pub(super) namespaces: Vec<(String, LabelSelector)>,
    pub(super) services: Vec<(String, LabelSelector)>,
}

/// An L2Advertisement or BGPAdvertisement, read.
pub(super) struct Advert {
    pub(super) id: String,
    pub(super) bgp: bool,
    /// Neither pools named nor pool selectors in the object: every pool.
    pub(super) all_pools: bool,
    pub(super) pool_names: Vec<(String, String)>,
    pub(super) pool_selectors: Vec<(String, LabelSelector)>,
    pub(super) nodes: Vec<(String, LabelSelector)>,
    pub(super) interfaces: Vec<(String, String)>,
    /// BGP settings that are set (not imported).
    pub(super) bgp_fields: Vec<String>,
}

impl Advert {
    pub(super) fn selects(&self, p: &Pool) -> bool {
        self.all_pools || self.pool_names.iter().any(|(_, n)| *n == p.name) || self.pool_selectors.iter().any(|(_, s)| label_selector_matches(s, &p.labels))
    }
}

/// A MetalLB address entry as the VipPool entry that holds the same addresses.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    /// An address, a range `a-b` or a CIDR (host bits cleared, as MetalLB reads it).
    As(String),
    /// An IPv6 CIDR of more than two addresses, written as the range of all of them:
    /// MetalLB hands out its first address (the first it hands out at all), which a
    /// VipPool leaves out of a CIDR (the subnet-router anycast address).
    Range6(Ipv6Net),
}

impl Entry {
    /// The VipPool's `addresses` entry.
    fn text(&self) -> String {
        match self {
            Entry::As(s) => s.clone(),
            Entry::Range6(n) => format!("{}-{}", n.network(), n.broadcast()),
        }
    }
}

/// A MetalLB address entry, IPv4 or IPv6: a CIDR, a range `a-b` (spaces allowed
/// around the dash) or an address; None when it is none of them.
fn entry(s: &str) -> Option<Entry> {
    let s = s.trim();
    if let Some((a, b)) = s.split_once('-') {
        let (a, b): (IpAddr, IpAddr) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        return (a.is_ipv4() == b.is_ipv4() && a <= b).then(|| Entry::As(format!("{a}-{b}")));
    }
    if s.contains('/') {
        return match s.parse::<IpNet>().ok()?.trunc() {
            IpNet::V6(n) if n.prefix_len() < 127 => Some(Entry::Range6(n)),
            n => Some(Entry::As(n.to_string())),
        };
    }
    s.parse::<IpAddr>().ok().map(|a| Entry::As(a.to_string()))
}

pub(super) fn read_pool(v: &Value, out: &mut Vec<Warning>) -> Option<Pool> {
    let id = object_id("IPAddressPool", v);
    let mut n = Notes { object: id.clone(), out };
    let Some(name) = v["metadata"]["name"].as_str() else {
        n.warn("metadata.name", "not imported: the pool has no name");
        return None;
    };
    let labels: BTreeMap<String, String> = serde_json::from_value(v["metadata"]["labels"].clone()).unwrap_or_default();
    let spec = &v["spec"];
    n.unknown_fields(spec, "spec", &["addresses", "autoAssign", "avoidBuggyIPs", "serviceAllocation"]);
    let mut addresses = Vec::new();
    for (path, a) in n.strings(&spec["addresses"], "spec.addresses") {
        match entry(&a) {
            Some(e @ Entry::Range6(net)) => {
                n.warn(
                    path,
                    format!(
                        "{a:?} written as the range {}: MetalLB hands out an IPv6 CIDR's first address ({}) too, which a VipPool leaves out \
                         of a CIDR (the subnet-router anycast address); the range keeps it for the Service MetalLB may have given it",
                        e.text(),
                        net.network()
                    ),
                );
                addresses.push(e.text());
            }
            Some(e) => addresses.push(e.text()),
            None => n.warn(path, format!("not imported: {a:?} is not an IPv4 or IPv6 address, CIDR or range")),
        }
    }
    let auto_assign = n.boolean(&spec["autoAssign"], "spec.autoAssign", true);
    let avoid_buggy_ips = n.boolean(&spec["avoidBuggyIPs"], "spec.avoidBuggyIPs", false);
    let alloc = &spec["serviceAllocation"];
    n.unknown_fields(alloc, "spec.serviceAllocation", &["priority", "namespaces", "namespaceSelectors", "serviceSelectors"]);
    let priority = match &alloc["priority"] {
        Value::Null => None,
        p => {
            let got = p.as_i64();
            if got.is_none() {
                n.warn("spec.serviceAllocation.priority", format!("not imported: {p} is not an integer"));
            }
            got
        }
    };
    let mut namespaces = Vec::new();
    let names: Vec<String> = n.strings(&alloc["namespaces"], "spec.serviceAllocation.namespaces").into_iter().map(|(_, s)| s).collect();
    if !names.is_empty() {
        let req = LabelSelectorRequirement { key: NAMESPACE_NAME_LABEL.into(), operator: "In".into(), values: Some(names) };
        namespaces.push(("spec.serviceAllocation.namespaces".to_owned(), LabelSelector { match_expressions: Some(vec![req]), match_labels: None }));
    }
    namespaces.extend(n.selectors(&alloc["namespaceSelectors"], "spec.serviceAllocation.namespaceSelectors"));
    let services = n.selectors(&alloc["serviceSelectors"], "spec.serviceAllocation.serviceSelectors");
    Some(Pool { id, name: name.to_owned(), labels, addresses, auto_assign, avoid_buggy_ips, priority, namespaces, services })
}

const BGP_ONLY_FIELDS: [&str; 5] = ["aggregationLength", "aggregationLengthV6", "localPref", "communities", "peers"];

pub(super) fn read_advert(kind: &str, v: &Value, out: &mut Vec<Warning>) -> Advert {
    let bgp = kind == "BGPAdvertisement";
    let id = object_id(kind, v);
    let mut n = Notes { object: id.clone(), out };
    let spec = &v["spec"];
    let mut known = vec!["ipAddressPools", "ipAddressPoolSelectors", "nodeSelectors"];
    if bgp {
        known.extend(BGP_ONLY_FIELDS);
    } else {
        known.push("interfaces");
    }
    n.unknown_fields(spec, "spec", &known);
    let bgp_fields = if bgp { BGP_ONLY_FIELDS.iter().filter(|f| !spec[**f].is_null()).map(|f| f.to_string()).collect() } else { Vec::new() };
    let none = |f: &str| spec[f].is_null() || spec[f].as_array().is_some_and(Vec::is_empty);
    Advert {
        bgp,
        all_pools: none("ipAddressPools") && none("ipAddressPoolSelectors"),
        pool_names: n.strings(&spec["ipAddressPools"], "spec.ipAddressPools"),
        pool_selectors: n.selectors(&spec["ipAddressPoolSelectors"], "spec.ipAddressPoolSelectors"),
        nodes: n.selectors(&spec["nodeSelectors"], "spec.nodeSelectors"),
        interfaces: if bgp { Vec::new() } else { n.strings(&spec["interfaces"], "spec.interfaces") },
        bgp_fields,
        id,
    }
}

/// What other MetalLB kinds are, for their warning.
pub(super) fn other_kind(kind: &str) -> &'static str {
    match kind {
        "BGPPeer" | "BFDProfile" | "Community" => {
            "not imported: vip's BGP speaker (announce: bgp) is file mode only so far (pools it should announce over BGP: `announce: lo`, `distribution: all` and a routing daemon on the nodes)"
        }
        "AddressPool" => "not imported: the AddressPool kind MetalLB 0.13 replaced; convert it to an IPAddressPool and an L2Advertisement first",
        _ => "not imported: a MetalLB kind with no equivalent in vip",
    }
}
