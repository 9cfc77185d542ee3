//! `vip-agent import metallb`: MetalLB's configuration (IPAddressPool and
//! L2Advertisement objects, `metallb.io`) as the equivalent VipPools.
//!
//! An IPAddressPool becomes a VipPool of the same name (Services' `address-pool`
//! annotations name it): its IPv4 and IPv6 addresses, `autoAssign`, `avoidBuggyIPs`
//! (as `includeNetworkAndBroadcast` and `excludedIPs`), `serviceAllocation`'s
//! namespaces and selectors; the L2Advertisements that select it give its
//! `nodeSelector` and `interfaces`. The pool hands out exactly the addresses MetalLB
//! did, so that every Service keeps its own: MetalLB hands out every address of a
//! CIDR (IPv4's network and broadcast addresses without `avoidBuggyIPs`, which only
//! concerns IPv4; IPv6's first, subnet-router anycast address, which a VipPool never
//! hands out from a CIDR: such a CIDR is written as a range, with a warning).
//! Whatever has no equivalent (BGP, selectors a VipPool cannot express, fields this
//! code does not know) is a [`Warning`] naming the object and the field: nothing is
//! dropped silently.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    net::{IpAddr, Ipv4Addr},
};

use anyhow::{Context as _, Result};
use ipnet::{IpNet, Ipv6Net};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use serde_json::Value;

use super::{
    allocate::label_selector_matches,
    crd::{validate, VipPool, VipPoolSpec},
    pools::check_pools,
};
use crate::{model::AnnounceMode, spec};

/// The label the API server gives every namespace: its name (Kubernetes 1.22+).
pub const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// MetalLB's own status objects: nothing to import, nothing to warn about.
const STATUS_KINDS: [&str; 3] = ["ServiceL2Status", "ServiceBGPStatus", "ConfigurationState"];

/// Something of MetalLB's configuration that is not imported as it was.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Warning {
    /// `IPAddressPool metallb-system/gold`.
    pub object: String,
    /// `spec.addresses[1]`; empty for the object as a whole.
    pub field: String,
    pub message: String,
}

/// One line, a YAML comment: the warnings can go to the same file as the pools.
impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.field.as_str() {
            "" => write!(f, "# warning: {}: {}", self.object, self.message),
            field => write!(f, "# warning: {}: {field}: {}", self.object, self.message),
        }
    }
}

/// What an import made.
#[derive(Debug, Default)]
pub struct Import {
    /// In MetalLB's order of preference (serviceAllocation.priority, then name).
    pub pools: Vec<VipPool>,
    pub warnings: Vec<Warning>,
    /// MetalLB objects read (status objects and Lists not counted).
    pub objects: usize,
}

/// The objects of a multi-document YAML (or JSON) text; empty documents skipped.
pub fn documents(text: &str) -> Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut out = Vec::new();
    for (k, doc) in serde_yaml_ng::Deserializer::from_str(text).enumerate() {
        let v = Value::deserialize(doc).with_context(|| format!("YAML document {}", k + 1))?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Every object of the `metallb.io` API group in `namespace` (where MetalLB reads
/// its configuration), each kind at its most stable version, as JSON.
pub async fn from_cluster(client: &kube::Client, namespace: &str) -> Result<Vec<Value>> {
    use kube::{
        api::{Api, DynamicObject, ListParams},
        discovery::{self, verbs, Scope},
    };
    let group = discovery::group(client, "metallb.io").await.context("the cluster serves no metallb.io API group (is MetalLB installed?)")?;
    let mut resources = group.resources_by_stability();
    resources.sort_by(|a, b| a.0.kind.cmp(&b.0.kind));
    let mut out = Vec::new();
    for (ar, caps) in resources.into_iter().filter(|(ar, caps)| !STATUS_KINDS.contains(&ar.kind.as_str()) && caps.supports_operation(verbs::LIST)) {
        let api: Api<DynamicObject> = match caps.scope {
            Scope::Namespaced => Api::namespaced_with(client.clone(), namespace, &ar),
            Scope::Cluster => Api::all_with(client.clone(), &ar),
        };
        let list = api.list(&ListParams::default()).await.with_context(|| format!("listing {} ({}) in namespace {namespace}", ar.kind, ar.api_version))?;
        for o in list.items {
            let mut v = serde_json::to_value(&o)?;
            // List items need not carry their type.
            v["apiVersion"] = ar.api_version.clone().into();
            v["kind"] = ar.kind.clone().into();
            out.push(v);
        }
    }
    Ok(out)
}

/// The VipPools as YAML documents, after a comment saying where they come from.
pub fn to_yaml(import: &Import) -> String {
    let mut out = format!(
        "# {} VipPool(s) imported from MetalLB's configuration by `vip-agent import metallb`, with {} warning(s) on stderr.\n",
        import.pools.len(),
        import.warnings.len()
    );
    for p in &import.pools {
        let mut v = serde_json::to_value(p).expect("a VipPool serializes");
        let spec = v["spec"].as_object_mut().expect("a spec");
        // Defaults left out: the output reads like a hand-written pool.
        if spec.get("excludedIPs").and_then(Value::as_array).is_some_and(Vec::is_empty) {
            spec.remove("excludedIPs");
        }
        if spec.get("announce").and_then(Value::as_str) == Some("arp") {
            spec.remove("announce");
        }
        if let Some(o) = v.as_object_mut() {
            o.retain(|_, x| !x.is_null());
        }
        out.push_str("---\n");
        out.push_str(&serde_yaml_ng::to_string(&v).expect("YAML"));
    }
    out
}

/// An object's name for warnings: `Kind namespace/name`.
fn object_id(kind: &str, v: &Value) -> String {
    let name = v["metadata"]["name"].as_str().unwrap_or("(no name)");
    match v["metadata"]["namespace"].as_str() {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}

/// Collects the warnings about one object.
struct Notes<'a> {
    object: String,
    out: &'a mut Vec<Warning>,
}

impl Notes<'_> {
    fn warn(&mut self, field: impl Into<String>, message: impl Into<String>) {
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

/// A selector with empty parts as absent, so that equal selectors compare equal.
fn normalized(mut s: LabelSelector) -> LabelSelector {
    s.match_labels = s.match_labels.filter(|m| !m.is_empty());
    s.match_expressions = s.match_expressions.filter(|e| !e.is_empty());
    s
}

fn matches_everything(s: &LabelSelector) -> bool {
    s.match_labels.is_none() && s.match_expressions.is_none()
}

/// `key In (values)` when that is all the selector says.
fn single_key_in(s: &LabelSelector) -> Option<(String, Vec<String>)> {
    match (&s.match_labels, s.match_expressions.as_deref()) {
        (Some(m), None) if m.len() == 1 => m.iter().next().map(|(k, v)| (k.clone(), vec![v.clone()])),
        (None, Some([e])) if e.operator == "In" => Some((e.key.clone(), e.values.clone().unwrap_or_default())),
        _ => None,
    }
}

/// The selector as plain labels (matchLabels, and `In` with one value), if it is that.
fn as_labels(s: &LabelSelector) -> Option<BTreeMap<String, String>> {
    let mut out = s.match_labels.clone().unwrap_or_default();
    for e in s.match_expressions.iter().flatten() {
        match e.values.as_deref() {
            Some([v]) if e.operator == "In" && out.get(&e.key).is_none_or(|x| x == v) => {
                out.insert(e.key.clone(), v.clone());
            }
            _ => return None,
        }
    }
    Some(out)
}

fn describe(s: &LabelSelector) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

/// One selector for what MetalLB ORs: all when one alternative selects all,
/// alternatives on one key merged into `key In (...)`, else the first one.
struct OneOf {
    selector: Option<LabelSelector>,
    /// The alternative kept when others were left out, and those left out.
    kept: Option<String>,
    dropped: Vec<String>,
}

fn one_of(alternatives: &[(String, LabelSelector)]) -> OneOf {
    let mut alts: Vec<&(String, LabelSelector)> = Vec::new();
    for a in alternatives {
        if !alts.iter().any(|b| b.1 == a.1) {
            alts.push(a);
        }
    }
    let exact = |selector| OneOf { selector, kept: None, dropped: Vec::new() };
    match alts.as_slice() {
        [] => return exact(None),
        _ if alts.iter().any(|a| matches_everything(&a.1)) => return exact(None),
        [one] => return exact(Some(one.1.clone())),
        _ => {}
    }
    let keyed: Option<Vec<(String, Vec<String>)>> = alts.iter().map(|a| single_key_in(&a.1)).collect();
    if let Some(keyed) = keyed.filter(|k| k.iter().all(|(key, _)| *key == k[0].0)) {
        let mut values: Vec<String> = Vec::new();
        for v in keyed.iter().flat_map(|(_, v)| v) {
            if !values.contains(v) {
                values.push(v.clone());
            }
        }
        let req = LabelSelectorRequirement { key: keyed[0].0.clone(), operator: "In".into(), values: Some(values) };
        return exact(Some(LabelSelector { match_expressions: Some(vec![req]), match_labels: None }));
    }
    OneOf { selector: Some(alts[0].1.clone()), kept: Some(alts[0].0.clone()), dropped: alts[1..].iter().map(|a| a.0.clone()).collect() }
}

/// An IPAddressPool, read.
struct Pool {
    id: String,
    name: String,
    labels: BTreeMap<String, String>,
    /// Its entries, IPv4 and IPv6, normalised (`a-b`, `net/len` with host bits
    /// cleared; an IPv6 CIDR of more than two addresses as the range of them all).
    addresses: Vec<String>,
    auto_assign: bool,
    avoid_buggy_ips: bool,
    priority: Option<i64>,
    namespaces: Vec<(String, LabelSelector)>,
    services: Vec<(String, LabelSelector)>,
}

/// An L2Advertisement or BGPAdvertisement, read.
struct Advert {
    id: String,
    bgp: bool,
    /// Neither pools named nor pool selectors in the object: every pool.
    all_pools: bool,
    pool_names: Vec<(String, String)>,
    pool_selectors: Vec<(String, LabelSelector)>,
    nodes: Vec<(String, LabelSelector)>,
    interfaces: Vec<(String, String)>,
    /// BGP settings that are set (not imported).
    bgp_fields: Vec<String>,
}

impl Advert {
    fn selects(&self, p: &Pool) -> bool {
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

fn read_pool(v: &Value, out: &mut Vec<Warning>) -> Option<Pool> {
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

fn read_advert(kind: &str, v: &Value, out: &mut Vec<Warning>) -> Advert {
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
fn other_kind(kind: &str) -> &'static str {
    match kind {
        "BGPPeer" | "BFDProfile" | "Community" => {
            "not imported: vip has no BGP speaker (pools it should announce over BGP: `announce: lo` and a routing daemon on the nodes)"
        }
        "AddressPool" => "not imported: the AddressPool kind MetalLB 0.13 replaced; convert it to an IPAddressPool and an L2Advertisement first",
        _ => "not imported: a MetalLB kind with no equivalent in vip",
    }
}

/// Imports the MetalLB objects among `objects` (Lists are opened); everything
/// else is warned about.
pub fn import(objects: &[Value]) -> Import {
    let mut warnings = Vec::new();
    let mut flat = Vec::new();
    fn open<'a>(v: &'a Value, flat: &mut Vec<&'a Value>) {
        match v["kind"].as_str() {
            Some(k) if k.ends_with("List") && v["items"].is_array() => v["items"].as_array().into_iter().flatten().for_each(|i| open(i, flat)),
            _ => flat.push(v),
        }
    }
    objects.iter().for_each(|o| open(o, &mut flat));
    let (mut pools, mut adverts, mut count) = (Vec::<Pool>::new(), Vec::new(), 0);
    for v in flat {
        let (api_version, kind) = (v["apiVersion"].as_str().unwrap_or(""), v["kind"].as_str().unwrap_or(""));
        if !api_version.starts_with("metallb.io/") {
            let what = if kind.is_empty() { "an object without a kind".to_owned() } else { format!("{api_version} {kind}") };
            warnings.push(Warning {
                object: object_id(if kind.is_empty() { "object" } else { kind }, v),
                field: String::new(),
                message: format!("skipped: not a MetalLB object ({what})"),
            });
            continue;
        }
        if STATUS_KINDS.contains(&kind) {
            continue;
        }
        count += 1;
        match kind {
            "IPAddressPool" => {
                if let Some(p) = read_pool(v, &mut warnings) {
                    match pools.iter().find(|q| q.name == p.name) {
                        Some(q) => warnings.push(Warning {
                            object: p.id.clone(),
                            field: "metadata.name".into(),
                            message: format!("not imported: VipPool {:?} comes from {} already (VipPools are cluster-wide)", p.name, q.id),
                        }),
                        None => pools.push(p),
                    }
                }
            }
            "L2Advertisement" | "BGPAdvertisement" => adverts.push(read_advert(kind, v, &mut warnings)),
            _ => warnings.push(Warning { object: object_id(kind, v), field: String::new(), message: other_kind(kind).into() }),
        }
    }
    // Advertisements that name a pool not given, or select none.
    for a in &adverts {
        for (path, name) in &a.pool_names {
            if !pools.iter().any(|p| p.name == *name) {
                warnings.push(Warning { object: a.id.clone(), field: path.clone(), message: format!("no IPAddressPool {name:?} among the objects read") });
            }
        }
        if !pools.iter().any(|p| a.selects(p)) && !pools.is_empty() {
            warnings.push(Warning { object: a.id.clone(), field: String::new(), message: "it selects no IPAddressPool among the objects read".into() });
        }
    }
    for a in adverts.iter().filter(|a| a.bgp) {
        let (with_l2, bgp_only): (Vec<&Pool>, Vec<&Pool>) =
            pools.iter().filter(|p| a.selects(p)).partition(|p| adverts.iter().any(|l2| !l2.bgp && l2.selects(p)));
        let names = |ps: &[&Pool]| ps.iter().map(|p| p.name.as_str()).collect::<Vec<_>>().join(", ");
        let mut msg = "not imported: vip has no BGP speaker".to_owned();
        if !a.bgp_fields.is_empty() {
            msg.push_str(&format!(" (set here, with no equivalent: {})", a.bgp_fields.join(", ")));
        }
        if !with_l2.is_empty() {
            msg.push_str(&format!("; {} also in an L2Advertisement: answered over ARP only", names(&with_l2)));
        }
        if !bgp_only.is_empty() {
            msg.push_str(&format!(
                "; {}: `announce: lo` (the node holding a VIP adds it to lo, for a routing daemon there to announce; one node holds each VIP)",
                names(&bgp_only)
            ));
        }
        warnings.push(Warning { object: a.id.clone(), field: String::new(), message: msg });
    }
    pools.sort_by(|a, b| (a.priority.is_none(), a.priority, &a.name).cmp(&(b.priority.is_none(), b.priority, &b.name)));
    let mut out = Vec::new();
    for p in &pools {
        if let Some(vp) = vip_pool(p, &adverts, &mut warnings) {
            out.push(vp);
        }
    }
    // Overlaps: vip uses the older of two pools (MetalLB refuses them).
    for c in check_pools(&out) {
        if let Some((reason, msg)) = c.problem {
            let id = pools.iter().find(|p| p.name == c.name).map_or_else(String::new, |p| p.id.clone());
            warnings.push(Warning { object: id, field: "spec.addresses".into(), message: format!("{reason}: {msg} (the newer of the two pools is not used)") });
        }
    }
    Import { pools: out, warnings, objects: count }
}

/// The VipPool of one IPAddressPool.
fn vip_pool(p: &Pool, adverts: &[Advert], warnings: &mut Vec<Warning>) -> Option<VipPool> {
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
            spec.announce = AnnounceMode::Lo;
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

#[cfg(test)]
mod tests;
