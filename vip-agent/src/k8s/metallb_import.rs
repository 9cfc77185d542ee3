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
use std::fmt;

use anyhow::{Context as _, Result};
use serde_json::Value;

use super::{crd::VipPool, pools::check_pools};

mod read;
mod selectors;
mod translate;

use read::{object_id, other_kind, read_advert, read_pool, Pool};
use translate::vip_pool;

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
        let mut msg = "not imported: vip's BGP speaker (announce: bgp) is file mode only so far".to_owned();
        if !a.bgp_fields.is_empty() {
            msg.push_str(&format!(" (set here, with no equivalent: {})", a.bgp_fields.join(", ")));
        }
        if !with_l2.is_empty() {
            msg.push_str(&format!("; {} also in an L2Advertisement: answered over ARP only", names(&with_l2)));
        }
        if !bgp_only.is_empty() {
            msg.push_str(&format!(
                "; {}: `announce: lo`, `distribution: all` (every eligible node adds the VIPs to lo, for a routing daemon there to announce them, as MetalLB's speakers did)",
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

#[cfg(test)]
mod tests;
