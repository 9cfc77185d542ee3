//! The custom resources (cluster-scoped, `vip.dev/v1alpha1`): `VipPool`, a pool of
//! VIPs, which Services may take them and which nodes may hold them; `VipStatus`,
//! what is done with one VIP in use (its holder, interface, backends). Their CRDs
//! are generated from these types (`vip-agent crd`, committed as deploy/crd.yaml).
use std::{collections::BTreeMap, net::IpAddr};

use ipnet::IpNet;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::{
    api::core::v1::Toleration,
    apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, Time},
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    addrs::AddrSet,
    maglev,
    model::{AnnounceMode, Distribution, Garp, HealthCheck, NoHealthyBackend},
    spec::{self, AddrEntry, FieldError, GratuitousArpSpec, HealthCheckSpec},
};

#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "vip.dev",
    version = "v1alpha1",
    kind = "VipPool",
    plural = "vippools",
    shortname = "vpool",
    doc = "A pool of IPv4 and IPv6 addresses (VIPs) that vip hands out to Services of type LoadBalancer, with the nodes that may hold them and how they announce and health-check them.",
    status = "VipPoolStatus",
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Total","type":"integer","jsonPath":".status.total"}"#,
    printcolumn = r#"{"name":"Allocated","type":"integer","jsonPath":".status.allocated"}"#,
    printcolumn = r#"{"name":"Free","type":"integer","jsonPath":".status.free"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VipPoolSpec {
    /// IPv4 and IPv6 addresses, CIDRs (every address of the block) and inclusive
    /// ranges (`198.18.1.10-198.18.1.20`, `2001:2::10-2001:2::ff`). The first
    /// address of an IPv6 CIDR (its subnet-router anycast address) is never handed
    /// out.
    pub addresses: Vec<String>,
    /// Addresses of the pool never handed out: addresses, CIDRs or ranges, each
    /// within `addresses`.
    #[serde(default, rename = "excludedIPs")]
    pub excluded_ips: Vec<String>,
    /// Hand out the network (first) and broadcast (last) address of each IPv4 CIDR
    /// in `addresses` too. Off (the default), they are skipped for blocks larger than a
    /// /31 (a /24 gives .1 to .254): many hosts and routers treat them as the
    /// subnet's own and drop or broadcast traffic to them (MetalLB's `avoidBuggyIPs`).
    /// Single addresses and ranges are always taken as written.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub include_network_and_broadcast: bool,
    /// Allocate from this pool to Services that do not ask for an address. Off: only
    /// Services that name an address of the pool (`loadBalancerIP`, annotation) get one.
    #[serde(default = "default_true")]
    pub auto_assign: bool,
    /// Services that may be allocated from this pool (all when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_selector: Option<LabelSelector>,
    /// Namespaces whose Services may be allocated from this pool (all when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Labels a node needs to hold this pool's VIPs (and to be a backend).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// Taints of eligible nodes this pool tolerates (NoSchedule/NoExecute taints
    /// not tolerated make a node ineligible).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tolerations: Vec<Toleration>,
    /// `arp`: the owner answers ARP for the VIP (XDP). `lo`: the VIP is only added to
    /// the owner's loopback, for a routing daemon (BGP/ECMP) to announce.
    #[serde(default)]
    pub announce: AnnounceMode,
    /// `one` (the default): each VIP is held by one eligible node, spread evenly,
    /// moved when it dies. `all` (with `announce: lo` only): every live eligible
    /// node holds every VIP on its loopback, so that each node's routing daemon
    /// announces it and the routers spread it by ECMP; the nodes share rings, so a
    /// flow a router moves to another node keeps its backend.
    #[serde(default, skip_serializing_if = "is_default")]
    pub distribution: Distribution,
    /// Maglev table size of this pool's services: a prime from 251 to 131071
    /// (default 16381). The API server refuses a number outside that range; one
    /// within it that is not a prime, the agent (the pool's `Ready` turns False
    /// naming `spec.tableSize`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = maglev::MIN_TABLE_SIZE, max = maglev::MAX_TABLE_SIZE))]
    pub table_size: Option<u32>,
    /// Health check of backend nodes (default: none; a node is a backend while Ready).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub health_check: Option<HealthCheckSpec>,
    /// What a Service of the pool does when the health check has every backend
    /// down. `FailOpen` (the default): new connections go to all of them (nodes
    /// whose agent is dead or that left the cluster stay out), as cloud load
    /// balancers do, since a check failing everywhere at once (kube-proxy
    /// restarting on every node) says more about the checks than the backends.
    /// `Drop`: new connections are dropped until a backend is healthy again.
    #[serde(default, skip_serializing_if = "is_default")]
    pub no_healthy_backend: NoHealthyBackend,
    /// Gratuitous ARP on takeover and while holding (default: the agent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gratuitous_arp: Option<GratuitousArpSpec>,
    /// Network interfaces where this pool's VIPs are answered, e.g. `[eth1, ens4]`:
    /// each node uses the first of them it has (list every name your nodes use); a
    /// node with none of them does not answer for the pool's VIPs. A VLAN sub-interface
    /// (`eth0.100`) confines the VIPs to that VLAN.
    ///
    /// Absent or empty (the default): on each node, the interface whose network
    /// contains the pool's first IPv4 address (else its first IPv6 address), else the
    /// one holding the node's address (the agent's `--iface` / `VIP_IFACE`, when set,
    /// takes precedence over all of these).
    ///
    /// Names are Linux interface names: 1 to 15 bytes, no '/', ':' or whitespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = MAX_POOL_INTERFACES), inner(length(min = 1, max = spec::IFNAME_MAX), pattern(r"^[^/:[:space:]]+$")))]
    pub interfaces: Vec<String>,
    /// The 802.1Q VLAN of that interface the pool's VIPs live on (1 to 4094), for
    /// nodes without a VLAN sub-interface: requests are answered in that VLAN only,
    /// frames to backends leave untagged on the nodes' own network. Absent:
    /// untagged (or the VLAN of a sub-interface named in `interfaces`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = spec::VLAN_MIN, max = spec::VLAN_MAX))]
    pub vlan: Option<u16>,
}

/// Most interfaces a pool lists (`spec.interfaces`).
pub const MAX_POOL_INTERFACES: usize = 16;

fn default_true() -> bool {
    true
}

fn is_default<T: Default + PartialEq>(v: &T) -> bool {
    *v == T::default()
}

#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VipPoolStatus {
    /// `Ready` (the spec is valid and in use) and `Conflicting` (it overlaps another
    /// pool or has bad entries), each with the field path in its message;
    /// `Programmed` (every service-port of the pool is in the data path);
    /// `StaleAllocations` (Services keep addresses of the pool its selectors no
    /// longer admit: an edited pool does not take a running Service's address); and
    /// `Held` (every VIP of the pool in use is held by a node; False naming those
    /// no node holds, and why).
    #[serde(default)]
    pub conditions: Vec<Condition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Addresses in the pool (after exclusions), allocated to Services, and free
    /// (4294967295 for counts that large, as an IPv6 /64's).
    #[serde(default)]
    pub total: u32,
    #[serde(default)]
    pub allocated: u32,
    #[serde(default)]
    pub free: u32,
    /// VIP → the node that holds it now.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub owners: BTreeMap<String, String>,
}

#[derive(CustomResource, Deserialize, Serialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "vip.dev",
    version = "v1alpha1",
    kind = "VipStatus",
    plural = "vipstatuses",
    shortname = "vipst",
    doc = "What vip does with one VIP in use: the node that holds it (answers ARP for it), where, since when, and the nodes its traffic is spread to. One per VIP in use, named after the address (see `spec.address`); created and deleted by vip's elected controller, its status written by the holder.",
    status = "VipState",
    printcolumn = r#"{"name":"VIP","type":"string","jsonPath":".spec.address"}"#,
    printcolumn = r#"{"name":"Holder","type":"string","jsonPath":".status.holder"}"#,
    printcolumn = r#"{"name":"Interface","type":"string","jsonPath":".status.interface"}"#,
    printcolumn = r#"{"name":"VLAN","type":"integer","jsonPath":".status.vlan"}"#,
    printcolumn = r#"{"name":"Since","type":"date","jsonPath":".status.heldSince"}"#,
    printcolumn = r#"{"name":"Last GARP","type":"date","jsonPath":".status.lastGratuitousArp"}"#,
    printcolumn = r#"{"name":"Backends","type":"string","jsonPath":".status.backends"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct VipStatusSpec {
    /// The VIP, as Services carry it (`198.18.1.10`, `2001:2::10`). The object's
    /// name is derived from it: an IPv4 address with `-` for `.` (`198-18-1-10`);
    /// an IPv6 address in its canonical compressed form with `-` for `:`
    /// (`2001-2--10`), and a `0` before a leading or after a trailing `::`
    /// (`0--1` for `::1`).
    pub address: String,
}

/// A VIP's status: every field is always written (null when unknown), so that a
/// new holder's server-side apply replaces all of its predecessor's.
#[derive(Deserialize, Serialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct VipState {
    /// The node that holds the VIP (answers ARP for it, or has it on its loopback
    /// for an `announce: lo` pool); null while no node holds it.
    #[serde(default)]
    pub holder: Option<String>,
    /// The holder's interface the VIP is answered on (the VLAN's parent for a
    /// pool's `vlan`).
    #[serde(default)]
    pub interface: Option<String>,
    /// The 802.1Q VLAN the VIP is answered in; null: untagged.
    #[serde(default)]
    #[schemars(range(min = spec::VLAN_MIN, max = spec::VLAN_MAX))]
    pub vlan: Option<u16>,
    /// Since when the holder's agent holds the VIP (its takeover, or the agent's
    /// start when it found the VIP already held by this node).
    #[serde(default)]
    pub held_since: Option<Time>,
    /// The holder's last gratuitous ARP for the VIP (takeover, refresh or answer to
    /// a conflict); null for an `announce: lo` pool.
    #[serde(default)]
    pub last_gratuitous_arp: Option<Time>,
    /// The nodes the holder spreads the VIP's new connections to (its ring), by name.
    #[serde(default)]
    pub backends: Vec<String>,
    /// `Held`: True while a node holds the VIP (reason `Held`); False with why when
    /// none does (`NoHolder`). `ArpConflict`, once a peer has checked who answers ARP
    /// for the VIP: True when a MAC other than the holder's answered
    /// (`ForeignAnswer`), False when only the holder's did (`HolderOnly`), Unknown
    /// when none did (`NoAnswer`).
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// The name of the VipStatus of `vip` (see [`VipStatusSpec::address`]): a valid
/// DNS-1123 subdomain, different for every address. IPv4 names have four
/// dash-separated numbers; IPv6 names have a `--` or eight groups, so the two never
/// meet. The canonical IPv6 form never starts with `0::` nor ends with `::0` (that
/// zero would be part of the `::`), so the `0` added for a leading or trailing `::`
/// is unambiguous too.
pub fn vip_status_name(vip: std::net::IpAddr) -> String {
    let text = vip.to_string().replace([':', '.'], "-");
    let text = if text.starts_with('-') { format!("0{text}") } else { text };
    if text.ends_with('-') {
        format!("{text}0")
    } else {
        text
    }
}

/// A VipPool's spec, checked: its addresses and settings as the model needs them.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidPool {
    /// IPv4 and IPv6 addresses, as ranges.
    pub addresses: AddrSet,
    pub table_size: u32,
    pub health: Option<HealthCheck>,
    pub announce: AnnounceMode,
    pub distribution: Distribution,
    pub garp: Option<Garp>,
    pub interfaces: Vec<String>,
    pub vlan: Option<u16>,
}

/// Checks a spec; errors carry the field path (`spec.addresses[2]`) and a message,
/// the way the pool's `Ready=False` condition shows them. `first_port` is the port a
/// health check defaults to when it names none.
pub fn validate(spec: &VipPoolSpec, first_port: u16) -> Result<ValidPool, FieldError> {
    let mut addresses = spec::pool_addresses_from_strings("spec", &spec.addresses, &spec.excluded_ips)?;
    let entries: Vec<AddrEntry> = spec.addresses.iter().filter_map(|a| a.parse().ok()).collect();
    // An address some other entry names on its own (or in a range) stays.
    let named = |a: IpAddr| {
        entries.iter().any(|e| match *e {
            AddrEntry::One(x) => x == a,
            AddrEntry::Range(lo, hi) => (lo..=hi).contains(&a),
            AddrEntry::Net(_) => false,
        })
    };
    for e in &entries {
        match e {
            AddrEntry::Net(IpNet::V4(n)) if !spec.include_network_and_broadcast && n.prefix_len() < 31 => {
                for a in [n.network(), n.broadcast()].map(IpAddr::V4).into_iter().filter(|a| !named(*a)) {
                    addresses.remove(a);
                }
            }
            // IPv6 subnet-router anycast addresses: left out by spec::pool_addresses.
            _ => {}
        }
    }
    if addresses.is_empty() {
        return Err(FieldError::new(
            "spec.addresses",
            "the pool has no address left after exclusions and network/broadcast (IPv4) or subnet-router anycast (IPv6) addresses",
        ));
    }
    let table_size = spec.table_size.unwrap_or(maglev::DEFAULT_TABLE_SIZE);
    maglev::check_table_size(table_size).map_err(|e| FieldError::new("spec.tableSize", e.to_string()))?;
    let health = match &spec.health_check {
        Some(h) => Some(spec::health_check("spec.healthCheck", h.clone(), first_port)?),
        None => None,
    };
    let garp = spec.gratuitous_arp.as_ref().map(|g| g.check("spec.gratuitousArp")).transpose()?;
    // The schema refuses most bad names already; "." and "..", duplicates, and names
    // over 15 bytes but within 15 characters (non-ASCII) it cannot.
    spec::interface_names("spec.interfaces", &spec.interfaces)?;
    if spec.interfaces.len() > MAX_POOL_INTERFACES {
        return Err(FieldError::new("spec.interfaces", format!("lists {} interfaces: at most {MAX_POOL_INTERFACES}", spec.interfaces.len())));
    }
    spec::vlan_id("spec.vlan", spec.vlan)?;
    spec::distribution("spec.distribution", spec.distribution, spec.announce)?;
    if spec.announce == AnnounceMode::Bgp {
        // Its sessions come from the config file's `bgp` section; no resource gives them yet.
        return Err(FieldError::new(
            "spec.announce",
            "`bgp` is for the config file (vip-agent run --config) so far: no resource gives BGP peers yet; use `lo` with your own speaker",
        ));
    }
    Ok(ValidPool {
        addresses,
        table_size,
        health,
        announce: spec.announce,
        distribution: spec.distribution,
        garp,
        interfaces: spec.interfaces.clone(),
        vlan: spec.vlan,
    })
}

/// The VipPool CRD: kube's, with a schema the API server takes without warnings.
/// schemars writes Rust's integer formats (`uint32`, `uint16`), which the server does
/// not know ("unrecognized format"): they become OpenAPI's `int64`/`int32` with the
/// type's range as bounds. And it takes doc comments verbatim, line breaks included:
/// descriptions get one line per paragraph (list items keep theirs).
pub fn crd() -> CustomResourceDefinition {
    use kube::CustomResourceExt;
    polished(VipPool::crd())
}

/// The VipStatus CRD, polished as [`crd`].
pub fn vip_status_crd() -> CustomResourceDefinition {
    use kube::CustomResourceExt;
    polished(VipStatus::crd())
}

fn polished(crd: CustomResourceDefinition) -> CustomResourceDefinition {
    let mut v = serde_json::to_value(crd).expect("a CRD serializes");
    for version in v["spec"]["versions"].as_array_mut().into_iter().flatten() {
        polish_schema(&mut version["schema"]["openAPIV3Schema"]);
    }
    serde_json::from_value(v).expect("a polished CRD deserializes")
}

/// Known formats for schemars' integer formats, with the range the Rust type has.
fn integer_format(format: &str) -> Option<(Option<&'static str>, i64, Option<i64>)> {
    Some(match format {
        "uint8" => (Some("int32"), 0, Some(u8::MAX.into())),
        "uint16" => (Some("int32"), 0, Some(u16::MAX.into())),
        "uint32" => (Some("int64"), 0, Some(u32::MAX.into())),
        "uint64" | "uint" => (Some("int64"), 0, None),
        "int8" => (Some("int32"), i8::MIN.into(), Some(i8::MAX.into())),
        "int16" => (Some("int32"), i16::MIN.into(), Some(i16::MAX.into())),
        _ => return None,
    })
}

fn polish_schema(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            if let Some((format, min, max)) = m.get("format").and_then(Value::as_str).and_then(integer_format) {
                match format {
                    Some(f) => m.insert("format".into(), f.into()),
                    None => m.remove("format"),
                };
                // A bound the type already has (`minimum: 0.0`) is kept, as an integer.
                let lo = m.get("minimum").and_then(Value::as_f64).map_or(min, |x| (x as i64).max(min));
                m.insert("minimum".into(), lo.into());
                if let Some(max) = max {
                    let hi = m.get("maximum").and_then(Value::as_f64).map_or(max, |x| (x as i64).min(max));
                    m.insert("maximum".into(), hi.into());
                }
            }
            if let Some(Value::String(d)) = m.get_mut("description") {
                *d = reflow(d);
            }
            m.values_mut().for_each(polish_schema);
        }
        Value::Array(a) => a.iter_mut().for_each(polish_schema),
        _ => {}
    }
}

/// A doc comment as a description: the lines of a paragraph joined with spaces;
/// paragraphs, and the items of a list (`- `, `* `), stay on lines of their own.
fn reflow(doc: &str) -> String {
    let paragraphs = doc.split("\n\n").map(|p| {
        let mut out = String::new();
        for line in p.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if !out.is_empty() {
                out.push(if line.starts_with("- ") || line.starts_with("* ") { '\n' } else { ' ' });
            }
            out.push_str(line);
        }
        out
    });
    paragraphs.filter(|p| !p.is_empty()).collect::<Vec<_>>().join("\n\n")
}

/// What a schema bound limits: a number's value, a string's length (characters),
/// a list's number of items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoundOf {
    Value,
    Length,
    Items,
}

/// A bound of a VipPool spec field in the CRD's schema, which the API server
/// enforces at apply time and [`validate`] enforces too (with the same constants:
/// `spec::GARP_COUNT_MIN`, `maglev::MIN_TABLE_SIZE`, ...): the field's path, `[]`
/// standing for a list's items (`spec.interfaces[]`), and its limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchemaBound {
    pub path: String,
    pub of: BoundOf,
    pub min: Option<i64>,
    pub max: Option<i64>,
}

/// Every bound of the VipPool spec's schema (`minimum`/`maximum` of integers,
/// `minLength`/`maxLength` of strings, `minItems`/`maxItems` of lists), in field
/// order: the tests hold the API server and [`validate`] to each, just within and
/// just outside, so that a bound added to either shows.
pub fn spec_bounds() -> Vec<SchemaBound> {
    fn walk(s: &serde_json::Value, path: &str, out: &mut Vec<SchemaBound>) {
        let int = |k: &str| s.get(k).and_then(serde_json::Value::as_f64).map(|f| f as i64);
        let keys = match s["type"].as_str() {
            Some("integer") => Some((BoundOf::Value, "minimum", "maximum")),
            Some("string") => Some((BoundOf::Length, "minLength", "maxLength")),
            Some("array") => Some((BoundOf::Items, "minItems", "maxItems")),
            _ => None,
        };
        if let Some((of, lo, hi)) = keys {
            let (min, max) = (int(lo), int(hi));
            if min.is_some() || max.is_some() {
                out.push(SchemaBound { path: path.to_owned(), of, min, max });
            }
        }
        if let Some(props) = s["properties"].as_object() {
            props.iter().for_each(|(k, p)| walk(p, &format!("{path}.{k}"), out));
        }
        if s["items"].is_object() {
            walk(&s["items"], &format!("{path}[]"), out);
        }
    }
    let crd = serde_json::to_value(crd()).expect("the CRD serializes");
    let mut out = Vec::new();
    walk(&crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"], "spec", &mut out);
    out
}

impl SchemaBound {
    /// The field as the API server and [`validate`] name it (`spec.interfaces[0]`).
    pub fn field(&self) -> String {
        self.path.replace("[]", "[0]")
    }

    /// A spec that is valid but for this field, which is `n`: the number `n`, a
    /// string of `n` characters, a list of `n` distinct items; a list's item is the
    /// only item of its list. Objects on the way have their required fields, from
    /// the first value their `enum` allows. The spec's other fields are valid
    /// (`addresses: [198.18.1.10]`).
    pub fn spec_with(&self, n: i64) -> serde_json::Value {
        use serde_json::{json, Value};
        let crd = serde_json::to_value(crd()).expect("the CRD serializes");
        let mut schema = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let mut spec = json!({ "addresses": ["198.18.1.10"] });
        let leaf = |s: &Value| match self.of {
            BoundOf::Value => json!(n),
            BoundOf::Length => json!("a".repeat(n as usize)),
            BoundOf::Items => {
                assert_eq!(s["items"]["type"], "string", "{}: teach SchemaBound::spec_with lists of other items", self.path);
                json!((0..n).map(|i| format!("e{i}")).collect::<Vec<_>>())
            }
        };
        let filled = |s: &Value| {
            let mut o = serde_json::Map::new();
            for r in s["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                let first = s["properties"][r]["enum"].get(0).unwrap_or_else(|| panic!("{}: teach SchemaBound::spec_with to fill `{r}`", self.path));
                o.insert(r.to_owned(), first.clone());
            }
            Value::Object(o)
        };
        let segments: Vec<&str> = self.path.strip_prefix("spec.").expect("a spec field").split('.').collect();
        let mut at = &mut spec;
        for (i, seg) in segments.iter().enumerate() {
            let (name, item) = seg.strip_suffix("[]").map_or((*seg, false), |n| (n, true));
            schema = &schema["properties"][name];
            let last = i + 1 == segments.len();
            let value = match (last, item) {
                (true, false) => leaf(schema),
                (true, true) => json!([leaf(&schema["items"])]),
                (false, false) => filled(schema),
                (false, true) => json!([filled(&schema["items"])]),
            };
            let obj = at.as_object_mut().expect("an object on the way");
            if last {
                obj.insert(name.to_owned(), value.clone());
            }
            let slot = obj.entry(name.to_owned()).or_insert(value);
            at = if item { &mut slot[0] } else { slot };
            if item {
                schema = &schema["items"];
            }
        }
        spec
    }
}

/// The CRDs as YAML documents (what `vip-agent crd` prints and deploy/crd.yaml holds).
pub fn crd_yaml() -> String {
    let header = "# Generated by `vip-agent crd` from vip-agent/src/k8s/crd.rs; do not edit.\n";
    let docs: Vec<String> = [crd(), vip_status_crd()].iter().map(|c| serde_yaml_ng::to_string(c).expect("a CRD serializes")).collect();
    format!("{header}{}", docs.join("---\n"))
}

#[cfg(test)]
mod tests;
