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
    model::{AnnounceMode, Garp, HealthCheck, NoHealthyBackend},
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
    Ok(ValidPool { addresses, table_size, health, announce: spec.announce, garp, interfaces: spec.interfaces.clone(), vlan: spec.vlan })
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
mod tests {
    use super::*;

    fn spec(yaml: &str) -> VipPoolSpec {
        serde_yaml_ng::from_str(yaml).unwrap()
    }

    #[test]
    fn valid_spec_fills_the_pool() {
        let s = spec("addresses: [198.18.1.10, 198.18.1.16/30]\nexcludedIPs: [198.18.1.17]\ntableSize: 251\nhealthCheck: {type: tcp}\n");
        assert!(s.auto_assign, "autoAssign defaults to true");
        assert_eq!(s.announce, AnnounceMode::Arp);
        let v = validate(&s, 443).unwrap();
        // .16/30 is .16 to .19: its network (.16) and broadcast (.19) are skipped, .17 excluded.
        assert_eq!(v.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>(), ["198.18.1.10", "198.18.1.18"]);
        assert_eq!(v.table_size, 251);
        assert_eq!(v.health.unwrap().probe, crate::model::Probe::Tcp { port: 443 });
        assert!(v.interfaces.is_empty(), "no interfaces: chosen by address");
        let v = validate(&spec("addresses: [198.18.1.10]\ninterfaces: [eth1, ens4.100]\n"), 80).unwrap();
        assert_eq!(v.interfaces, ["eth1", "ens4.100"]);
    }

    /// deploy/examples/pool.yaml shows `interfaces` commented out: valid once uncommented.
    #[test]
    fn example_pool_interfaces_are_valid() {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples/pool.yaml")).unwrap();
        assert!(text.contains("\n  # interfaces: ["), "the example shows a pool's interfaces");
        let pool: VipPool = serde_yaml_ng::from_str(&text.replace("\n  # interfaces: ", "\n  interfaces: ")).unwrap();
        assert_eq!(validate(&pool.spec, 80).unwrap().interfaces, ["eth0", "ens3", "eno1.100"]);
    }

    #[test]
    fn cidrs_skip_network_and_broadcast_unless_asked() {
        let ips = |y: &str| validate(&spec(y), 80).map(|v| v.addresses.iter().map(|a| a.to_string()).collect::<Vec<_>>());
        let v = ips("addresses: [198.18.1.0/24]\n").unwrap();
        assert_eq!((v.len(), v[0].as_str(), v[253].as_str()), (254, "198.18.1.1", "198.18.1.254"));
        assert_eq!(ips("addresses: [198.18.1.0/24]\nincludeNetworkAndBroadcast: true\n").unwrap().len(), 256);
        // /31 and /32 have no network or broadcast address to skip.
        assert_eq!(ips("addresses: [198.18.1.0/31, 198.18.1.7/32]\n").unwrap(), ["198.18.1.0", "198.18.1.1", "198.18.1.7"]);
        // Named on its own or in a range: kept.
        assert_eq!(ips("addresses: [198.18.1.0/30, 198.18.1.3, 198.18.1.0-198.18.1.0]\n").unwrap(), ["198.18.1.0", "198.18.1.1", "198.18.1.2", "198.18.1.3"]);
        let FieldError { path, message: msg } = ips("addresses: [198.18.1.0/30]\nexcludedIPs: [198.18.1.1, 198.18.1.2]\n").unwrap_err();
        assert_eq!(path, "spec.addresses");
        assert!(msg.contains("network/broadcast"), "{msg}");
    }

    /// IPv6 entries: the first address of a prefix (subnet-router anycast) is never
    /// handed out, ranges and exclusions work as for IPv4, a /64 stays a range.
    #[test]
    fn ipv6_pools() {
        let ranges = |y: &str| {
            validate(&spec(y), 80).map(|v| v.addresses.ranges().map(|(a, b)| if a == b { a.to_string() } else { format!("{a}-{b}") }).collect::<Vec<_>>())
        };
        type Want<'a> = Result<&'a [&'a str], (&'a str, &'a str)>;
        let cases: &[(&str, Want)] = &[
            ("addresses: [2001:2::/64]\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
            ("addresses: [2001:2::/64]\nincludeNetworkAndBroadcast: true\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
            ("addresses: [2001:2::/64, \"2001:2::\"]\n", Ok(&["2001:2::1-2001:2::ffff:ffff:ffff:ffff"])),
            ("addresses: [2001:2::/127]\n", Ok(&["2001:2::-2001:2::1"])),
            ("addresses: [2001:2::10-2001:2::20]\nexcludedIPs: [2001:2::18/125, 2001:2::10]\n", Ok(&["2001:2::11-2001:2::17", "2001:2::20"])),
            ("addresses: [198.18.1.8/30, 2001:2::/126]\n", Ok(&["198.18.1.9-198.18.1.10", "2001:2::1-2001:2::3"])),
            ("addresses: [2001:2::/128]\n", Ok(&["2001:2::"])),
            ("addresses: [2001:2::/126]\nexcludedIPs: [2001:2::1-2001:2::3]\n", Err(("spec.addresses", "subnet-router anycast"))),
            ("addresses: [2001:2::1/64]\n", Err(("spec.addresses[0]", "has host bits set; did you mean 2001:2::/64?"))),
            ("addresses: [198.18.1.1-2001:2::1]\n", Err(("spec.addresses[0]", "mixes an IPv4 and an IPv6 address"))),
            ("addresses: [2001:2::/64]\nexcludedIPs: [2001:3::1]\n", Err(("spec.excludedIPs[0]", "2001:3::1 is not in this pool's addresses"))),
            ("addresses: [\"2001:2::g\"]\n", Err(("spec.addresses[0]", "is not an IPv4 or IPv6 address"))),
        ];
        for (y, want) in cases {
            match (ranges(y), want) {
                (Ok(got), Ok(w)) => assert_eq!(got, *w, "{y}"),
                (Err(FieldError { path, message }), Err((p, m))) => assert!(path == *p && message.contains(m), "{y}: {path}: {message}"),
                (got, _) => panic!("{y}: {got:?}"),
            }
        }
    }

    #[test]
    fn bad_specs_name_the_field() {
        let cases = [
            ("addresses: [198.18.1.10, nonsense]\n", "spec.addresses[1]", "is not an IPv4 or IPv6 address, CIDR"),
            ("addresses: [198.18.1.10]\nexcludedIPs: [198.18.1.11]\n", "spec.excludedIPs[0]", "198.18.1.11 is not in this pool's addresses"),
            ("addresses: [198.18.1.10]\nexcludedIPs: [x]\n", "spec.excludedIPs[0]", "\"x\" is not an IPv4 or IPv6 address"),
            ("addresses: [198.18.1.10]\nexcludedIPs: [198.18.1.10]\n", "spec.addresses", "no address left"),
            ("addresses: [198.18.1.10]\ntableSize: 1000\n", "spec.tableSize", "table size 1000 is not a prime"),
            ("addresses: [198.18.1.10]\nhealthCheck: {type: tcp, rise: 0}\n", "spec.healthCheck.rise", "must be at least 1"),
            ("addresses: [198.18.1.10]\ngratuitousArp: {count: 3, interval: 100ms, refresh: 0s}\n", "spec.gratuitousArp.refresh", "at least 1s"),
            ("addresses: [198.18.1.10]\ngratuitousArp: {count: 0}\n", "spec.gratuitousArp.count", "from 1 to 100"),
            ("addresses: [198.18.1.10]\ninterfaces: [eth0, \"..\"]\n", "spec.interfaces[1]", "\"..\" is not an interface name"),
            ("addresses: [198.18.1.10]\ninterfaces: [eth0, ens3, eth0]\n", "spec.interfaces[2]", "\"eth0\" is already listed at spec.interfaces[0]"),
            // 8 characters, 16 bytes: within the schema's maxLength (characters), over the kernel's limit (bytes).
            ("addresses: [198.18.1.10]\ninterfaces: [éééééééé]\n", "spec.interfaces[0]", "1 to 15 bytes"),
            ("addresses: [198.18.1.10]\ninterfaces: [\"eth0:1\"]\n", "spec.interfaces[0]", "it contains ':'"),
        ];
        for (y, path, msg) in cases {
            let FieldError { path: p, message: m } = validate(&spec(y), 80).unwrap_err();
            assert_eq!(p, path, "{y}");
            assert!(m.contains(msg), "{y}: {m}");
        }
    }

    /// The schema's bounds are the agent's: every bound of the spec's schema
    /// ([`spec_bounds`]), at its limits, is taken by validate(); just outside them,
    /// refused naming the field (or not even read, past what the Rust type holds).
    /// A bound only validate() knows of fails here for integers (the schema's range
    /// is then wider than the agent's); one only the schema knows of fails too.
    #[test]
    fn validate_and_the_schema_agree_at_the_bounds() {
        use spec::{GARP_COUNT_MAX, GARP_COUNT_MIN, IFNAME_MAX, PROBE_PORT_MIN, RISE_FALL_MIN, VLAN_MAX, VLAN_MIN};
        let bound = |path: &str, of, min: Option<i64>, max: i64| SchemaBound { path: path.into(), of, min, max: Some(max) };
        let mut want = vec![
            bound("spec.gratuitousArp.count", BoundOf::Value, Some(GARP_COUNT_MIN.into()), GARP_COUNT_MAX.into()),
            bound("spec.healthCheck.fall", BoundOf::Value, Some(RISE_FALL_MIN.into()), u32::MAX.into()),
            bound("spec.healthCheck.port", BoundOf::Value, Some(PROBE_PORT_MIN.into()), u16::MAX.into()),
            bound("spec.healthCheck.rise", BoundOf::Value, Some(RISE_FALL_MIN.into()), u32::MAX.into()),
            bound("spec.interfaces", BoundOf::Items, None, MAX_POOL_INTERFACES as i64),
            bound("spec.interfaces[]", BoundOf::Length, Some(1), IFNAME_MAX as i64),
            bound("spec.tableSize", BoundOf::Value, Some(maglev::MIN_TABLE_SIZE.into()), maglev::MAX_TABLE_SIZE.into()),
            bound("spec.vlan", BoundOf::Value, Some(VLAN_MIN.into()), VLAN_MAX.into()),
        ];
        let mut got = spec_bounds();
        want.sort_by(|a, b| a.path.cmp(&b.path));
        got.sort_by(|a, b| a.path.cmp(&b.path));
        assert_eq!(got, want, "the schema's bounds: a new one is defined by a constant that validate() checks too");

        let check = |v: &serde_json::Value| -> Result<(), Option<FieldError>> {
            let s: VipPoolSpec = serde_json::from_value(v.clone()).map_err(|_| None)?;
            validate(&s, 80).map(drop).map_err(Some)
        };
        for b in spec_bounds() {
            let inside = [b.min, b.max].into_iter().flatten();
            for n in inside {
                let v = b.spec_with(n);
                assert_eq!(check(&v), Ok(()), "{}: {n} is within the schema's bounds: {v}", b.path);
            }
            let outside = [b.min.filter(|m| *m > 0).map(|m| m - 1), b.max.map(|m| m + 1)].into_iter().flatten();
            for n in outside {
                let v = b.spec_with(n);
                match check(&v) {
                    Ok(()) => panic!("{}: validate() takes {n}, outside the schema's bounds: {v}", b.path),
                    Err(Some(e)) => assert_eq!(e.path, b.field(), "{}: {n}: {e}", b.path),
                    // Not a number of the Rust type (u32 past 4294967295): refused as it is read.
                    Err(None) => {}
                }
            }
        }
        // What the schema cannot say: a table size within the range is still refused
        // unless it is a prime (by the agent, naming the field).
        let mid = SchemaBound { path: "spec.tableSize".into(), of: BoundOf::Value, min: None, max: None };
        let e = check(&mid.spec_with(1000)).unwrap_err().expect("read");
        assert_eq!((e.path.as_str(), e.message.as_str()), ("spec.tableSize", "table size 1000 is not a prime between 251 and 131071"));

        // Descriptions that state a bound state the constant's.
        let v = serde_json::to_value(crd()).unwrap();
        let props = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
        for (d, says) in [
            (&props["tableSize"], format!("a prime from {} to {}", maglev::MIN_TABLE_SIZE, maglev::MAX_TABLE_SIZE)),
            (&props["gratuitousArp"]["properties"]["count"], format!("({GARP_COUNT_MIN} to {GARP_COUNT_MAX})")),
            (&props["vlan"], format!("({VLAN_MIN} to {VLAN_MAX})")),
            (&props["interfaces"], format!("1 to {IFNAME_MAX} bytes")),
        ] {
            let d = d["description"].as_str().unwrap_or_default();
            assert!(d.contains(&says), "{d:?} does not say {says:?}");
        }
    }

    /// deploy/crd.yaml is what `vip-agent crd` prints: regenerate it with
    /// `cargo run -p vip-agent -- crd > deploy/crd.yaml` when the types change.
    #[test]
    fn committed_crd_matches_the_types() {
        let committed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/crd.yaml")).unwrap();
        assert!(
            committed == crd_yaml(),
            "deploy/crd.yaml drifted from the VipPool types; regenerate it with `cargo run -p vip-agent -- crd > deploy/crd.yaml`"
        );
    }

    /// The server warns about formats it does not know (`unrecognized format "uint32"`),
    /// descriptions are one line per paragraph, and the CRD describes itself.
    #[test]
    fn crd_schema_uses_known_formats_and_reflowed_descriptions() {
        fn walk(v: &serde_json::Value, path: &str, out: &mut Vec<String>) {
            match v {
                serde_json::Value::Object(m) => {
                    if let Some(f) = m.get("format").and_then(|f| f.as_str()) {
                        if !["int32", "int64", "float", "double", "byte", "date", "date-time", "duration", "password"].contains(&f) {
                            out.push(format!("{path}: format {f}"));
                        }
                    }
                    if let Some(d) = m.get("description").and_then(|d| d.as_str()) {
                        for para in d.split("\n\n") {
                            if para.lines().skip(1).any(|l| !l.starts_with("- ") && !l.starts_with("* ")) {
                                out.push(format!("{path}: description broken mid-paragraph: {d:?}"));
                            }
                        }
                    }
                    m.iter().for_each(|(k, v)| walk(v, &format!("{path}.{k}"), out));
                }
                serde_json::Value::Array(a) => a.iter().enumerate().for_each(|(i, v)| walk(v, &format!("{path}[{i}]"), out)),
                _ => {}
            }
        }
        let v = serde_json::to_value(crd()).unwrap();
        let schema = &v["spec"]["versions"][0]["schema"]["openAPIV3Schema"];
        let mut bad = Vec::new();
        walk(schema, "", &mut bad);
        assert!(bad.is_empty(), "{bad:#?}");
        let d = schema["description"].as_str().unwrap();
        assert!(d.starts_with("A pool of IPv4 and IPv6 addresses") && !d.contains("Auto-generated"), "{d}");
        let table = &schema["properties"]["spec"]["properties"]["tableSize"];
        assert_eq!(
            (table["format"].as_str(), table["minimum"].as_f64(), table["maximum"].as_f64()),
            (Some("int64"), Some(maglev::MIN_TABLE_SIZE.into()), Some(maglev::MAX_TABLE_SIZE.into()))
        );
        let addresses = schema["properties"]["spec"]["properties"]["addresses"]["description"].as_str().unwrap();
        assert!(
            addresses.starts_with(
                "IPv4 and IPv6 addresses, CIDRs (every address of the block) and inclusive ranges (`198.18.1.10-198.18.1.20`, `2001:2::10-2001:2::ff`)."
            ),
            "{addresses}"
        );
        let ifaces = &schema["properties"]["spec"]["properties"]["interfaces"];
        let item = &ifaces["items"];
        assert_eq!(
            (ifaces["maxItems"].as_u64(), item["minLength"].as_u64(), item["maxLength"].as_u64(), item["pattern"].as_str()),
            (Some(16), Some(1), Some(spec::IFNAME_MAX as u64), Some("^[^/:[:space:]]+$")),
            "{ifaces}"
        );
        assert_eq!(reflow("a\nb\n\nlist:\n- one\n  more\n- two"), "a b\n\nlist:\n- one more\n- two");
    }

    /// Names are DNS-1123 subdomains (what the API server takes for a custom
    /// resource), one per address.
    #[test]
    fn vip_status_names_are_valid_and_unique() {
        let cases = [
            ("198.18.1.10", "198-18-1-10"),
            ("0.0.0.0", "0-0-0-0"),
            ("2001:2::10", "2001-2--10"),
            ("2001:2::", "2001-2--0"),
            ("::1", "0--1"),
            ("::", "0--0"),
            ("2001:db8:0:0:1:0:0:1", "2001-db8--1-0-0-1"),
            ("2001:2:3:4:5:6:7:8", "2001-2-3-4-5-6-7-8"),
            ("2001:2::ABCD", "2001-2--abcd"),
            ("::ffff:198.18.1.1", "0--ffff-198-18-1-1"),
        ];
        for (a, want) in cases {
            assert_eq!(vip_status_name(a.parse().unwrap()), want, "{a}");
        }
        let mut seen = std::collections::BTreeMap::new();
        let v4 = (0..=255u8).flat_map(|b| [IpAddr::from([198, 18, b, 1]), IpAddr::from([198, 19, 1, b]), IpAddr::from([b, 0, 0, b])]);
        let v6 = (0..=0xffu16).flat_map(|g| {
            [
                IpAddr::from([0x2001, 2, 0, 0, 0, 0, 0, g]),
                IpAddr::from([g, 0, 0, 0, 0, 0, 0, 0]),
                IpAddr::from([0, 0, 0, 0, 0, 0, 0, g]),
                IpAddr::from([0x2001, g, 0, 0, 1, 0, 0, 1]),
                IpAddr::from([0, g, 0, 0, 0, 0, g, 0]),
                IpAddr::from([0, 0, 0, 0, 0, 0xffff, 0xc612, g]),
            ]
        });
        for a in v4.chain(v6) {
            let n = vip_status_name(a);
            assert!(n.len() <= 253 && n.split('.').all(dns1123_label), "{a}: {n:?} is not a DNS-1123 subdomain");
            if let Some(b) = seen.insert(n.clone(), a) {
                assert_eq!(a, b, "{a} and {b} both named {n}");
            }
        }
    }

    /// A DNS-1123 label: 1 to 63 of `[a-z0-9-]`, starting and ending alphanumeric.
    fn dns1123_label(l: &str) -> bool {
        let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
        !l.is_empty() && l.len() <= 63 && l.starts_with(ok) && l.ends_with(ok) && l.chars().all(|c| ok(c) || c == '-')
    }

    /// Every status field is nullable or a list, so that a new holder's apply (all
    /// fields named, null when unknown) replaces the previous holder's values; the
    /// columns are those the docs describe.
    #[test]
    fn vip_status_crd_columns_and_nullable_status() {
        let v = serde_json::to_value(vip_status_crd()).unwrap();
        let version = &v["spec"]["versions"][0];
        let cols: Vec<(&str, &str)> =
            version["additionalPrinterColumns"].as_array().unwrap().iter().map(|c| (c["name"].as_str().unwrap(), c["jsonPath"].as_str().unwrap())).collect();
        assert_eq!(
            cols,
            [
                ("VIP", ".spec.address"),
                ("Holder", ".status.holder"),
                ("Interface", ".status.interface"),
                ("VLAN", ".status.vlan"),
                ("Since", ".status.heldSince"),
                ("Last GARP", ".status.lastGratuitousArp"),
                ("Backends", ".status.backends")
            ]
        );
        assert_eq!((v["spec"]["scope"].as_str(), v["spec"]["names"]["plural"].as_str()), (Some("Cluster"), Some("vipstatuses")));
        let status = &version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
        for (field, schema) in status.as_object().unwrap() {
            assert!(schema["nullable"] == true || schema["type"] == "array", "status.{field} is neither nullable nor a list: {schema}");
        }
        let full = serde_json::to_value(VipState::default()).unwrap();
        assert_eq!(full.as_object().unwrap().len(), status.as_object().unwrap().len(), "every field is serialized, null included: {full}");
        assert_eq!((status["vlan"]["minimum"].as_f64(), status["vlan"]["maximum"].as_f64()), (Some(1.0), Some(4094.0)));
    }

    #[test]
    fn crd_has_status_subresource_and_conditions() {
        let y = crd_yaml();
        for want in [
            "name: vippools.vip.dev",
            "scope: Cluster",
            "status: {}",
            "conditions:",
            "excludedIPs:",
            "autoAssign:",
            "includeNetworkAndBroadcast:",
            "nodeSelector:",
            "tolerations:",
            "interfaces:",
        ] {
            assert!(y.contains(want), "CRD lacks {want:?}:\n{y}");
        }
    }
}
