//! What the real registry does with a Service on its own, as the load-balancer
//! controller and the tests see it (kube-apiserver v1.36; each rule checked against
//! the real server, see tests/tests/k8s_strict.rs and k8s_addresses.rs):
//!
//! - defaults: `type` ClusterIP, `sessionAffinity` None, ports' `protocol` TCP and
//!   `targetPort` = `port`, `externalTrafficPolicy` Cluster (NodePort,
//!   LoadBalancer), `internalTrafficPolicy` Cluster, `allocateLoadBalancerNodePorts`
//!   true (LoadBalancer), `ipFamilies`/`ipFamilyPolicy` with an allocated address;
//! - allocation, with the cluster-wide uniqueness the real allocators keep: a
//!   `clusterIP` from 10.96.0.0/16 (the tests' `--service-cluster-ip-range`;
//!   dynamic ones above the static band, from 10.96.1.0), `nodePort`s from
//!   30000-32767 (the default `--service-node-port-range`; dynamic ones above the
//!   static band, from 30086) for NodePort Services and LoadBalancers unless
//!   `allocateLoadBalancerNodePorts: false`, and a `healthCheckNodePort` for
//!   LoadBalancers with `externalTrafficPolicy: Local`. A requested one outside the
//!   range or taken is a 422 naming the field, except `healthCheckNodePort`, which
//!   the real server answers with a 500 InternalError (no field). On create the
//!   allocators run before validation, on update after it, as on the real server;
//! - validation (every failure one cause of a 422 Invalid): the type and ports
//!   (`port` and `targetPort` 1-65535, protocol, names required when there are
//!   several and unique), `nodePort` not on ClusterIP, `healthCheckNodePort` only
//!   with LoadBalancer and Local, `externalTrafficPolicy` only on NodePort and
//!   LoadBalancer, `allocateLoadBalancerNodePorts` and `loadBalancerClass` only on
//!   LoadBalancer, `clusterIP` a valid address (`None` not on NodePort or
//!   LoadBalancer, nothing on ExternalName, which needs `externalName`) and equal
//!   to `clusterIPs[0]`;
//! - on update: what the request leaves out keeps its allocated value (clusterIP,
//!   nodePorts by port name, healthCheckNodePort); `clusterIP` may not change
//!   (except to and from ExternalName), nor `healthCheckNodePort` while it is
//!   needed, nor `loadBalancerClass` while the Service stays a LoadBalancer; a
//!   change of type or traffic policy drops the fields the new one has no use for
//!   when the request left them as they were (clusterIP for ExternalName, nodePorts,
//!   healthCheckNodePort, externalTrafficPolicy, allocateLoadBalancerNodePorts,
//!   loadBalancerClass) and, away from LoadBalancer, clears `status.loadBalancer`;
//! - families ([`Stack`]), as on a cluster with one (IPv4) service CIDR:
//!   `ipFamilyPolicy` one of SingleStack (the default), PreferDualStack (kept, with
//!   `ipFamilies` `[IPv4]`) or RequireDualStack (refused: no dual-stack here),
//!   `ipFamilies` IPv4 (IPv6 refused: not configured), SingleStack with two
//!   families refused; on a dual-stack cluster (IPv4 primary) a dual-stack policy
//!   adds the other family after the one named, each family gets a clusterIP from
//!   its CIDR in `ipFamilies`' order, SingleStack becoming PreferDualStack or
//!   RequireDualStack gets the second one and going back drops it, the primary
//!   family cannot change (its clusterIP would not match, as for any clusterIP of
//!   the other family), duplicate families and `clusterIPs` without `clusterIP`
//!   are refused; on an IPv6-only cluster the same as on an IPv4-only one with the
//!   families swapped;
//! - the status subresource: `status.loadBalancer.ingress` only for LoadBalancers,
//!   each `ip` a valid address of either family (not held to `ipFamilies`).
//!
//! Allocated values are derived from the stored Services, so deleting a Service
//! frees them at once (the real allocators' repair loop takes minutes).
use std::{
    collections::BTreeSet,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    ops::RangeInclusive,
};

use serde_json::{json, Map, Value};

use super::{store::Part, ApiError, Cause};

/// The real server's default `--service-node-port-range`.
pub const NODE_PORTS: RangeInclusive<i64> = 30000..=32767;
/// Where dynamic nodePorts start: above the static band (KEP-3668:
/// min(max(16, size/32), 128) ports), which requests are left to.
const NODE_PORTS_DYNAMIC: i64 = 30000 + 86;
/// The tests' real server's `--service-cluster-ip-range` (tests/src/kubeapi.rs).
const CLUSTER_IP_NET: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 0);
const CLUSTER_IP_PREFIX: u32 = 16;
/// Its IPv6 range on a dual-stack cluster (`kubeapi::DUAL_STACK_SERVICE_CIDR`).
const CLUSTER_IP6_NET: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x10, 0x96, 0, 0, 0, 0, 0);
const CLUSTER_IP6_PREFIX: u32 = 112;
/// Dynamic clusterIPs start above the static band (KEP-3070: min(max(16, size/16), 256) addresses).
const CLUSTER_IP_STATIC_BAND: u32 = 256;

/// The cluster's service CIDRs: 10.96.0.0/16 (IPv4 only, the default), or also
/// fd00:10:96::/112 (dual-stack, IPv4 primary), or that one alone (IPv6-only): the
/// tests' real servers' `--service-cluster-ip-range` (tests/src/kubeapi.rs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Stack {
    #[default]
    V4,
    Dual,
    V6,
}

impl Stack {
    /// The families configured, the primary first.
    pub fn families(self) -> &'static [&'static str] {
        match self {
            Stack::V4 => &["IPv4"],
            Stack::Dual => &["IPv4", "IPv6"],
            Stack::V6 => &["IPv6"],
        }
    }

    /// `v4` and `v6` as far as the stack has each family, the primary first.
    pub fn pick<T>(self, v4: T, v6: T) -> Vec<T> {
        match self {
            Stack::V4 => vec![v4],
            Stack::Dual => vec![v4, v6],
            Stack::V6 => vec![v6],
        }
    }

    /// Whether the stack has IPv6 (`Dual` or `V6`).
    pub fn has_v6(self) -> bool {
        self != Stack::V4
    }
}

const VALID_IP: &str = "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)";

/// What other Services hold, cluster-wide.
#[derive(Default)]
pub(super) struct Used {
    ports: BTreeSet<i64>,
    ips: BTreeSet<String>,
}

impl Used {
    pub(super) fn of<'a>(others: impl IntoIterator<Item = &'a Value>) -> Self {
        let mut u = Used::default();
        for s in others {
            let spec = &s["spec"];
            u.ports.extend(ports(s).iter().filter_map(|p| p["nodePort"].as_i64()));
            u.ports.extend(spec["healthCheckNodePort"].as_i64());
            u.ips.extend(spec["clusterIPs"].as_array().into_iter().flatten().chain([&spec["clusterIP"]]).filter_map(Value::as_str).map(str::to_owned));
        }
        u.ips.remove("None");
        u.ips.remove("");
        u
    }
}

fn ty(svc: &Value) -> &str {
    svc["spec"]["type"].as_str().unwrap_or("ClusterIP")
}

fn is_lb(svc: &Value) -> bool {
    ty(svc) == "LoadBalancer"
}

fn needs_cluster_ip(svc: &Value) -> bool {
    ty(svc) != "ExternalName"
}

fn needs_node_ports(svc: &Value) -> bool {
    ty(svc) == "NodePort" || (is_lb(svc) && svc["spec"]["allocateLoadBalancerNodePorts"] != false)
}

fn needs_hcnp(svc: &Value) -> bool {
    is_lb(svc) && svc["spec"]["externalTrafficPolicy"] == "Local"
}

fn externally_accessible(svc: &Value) -> bool {
    matches!(ty(svc), "LoadBalancer" | "NodePort")
}

fn ports(svc: &Value) -> &[Value] {
    svc["spec"]["ports"].as_array().map_or(&[], Vec::as_slice)
}

/// A set integer field (the real server treats 0 as unset).
fn set_int(v: &Value) -> Option<i64> {
    v.as_i64().filter(|n| *n != 0)
}

fn cluster_ips(svc: &Value) -> Vec<String> {
    svc["spec"]["clusterIPs"].as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
}

fn spec_mut(svc: &mut Value) -> &mut Map<String, Value> {
    if !svc["spec"].is_object() {
        svc["spec"] = json!({});
    }
    svc["spec"].as_object_mut().expect("spec is an object")
}

/// Go's `%q` of a []string, as the real server prints clusterIPs: `["10.96.0.5"]`.
fn quoted_list(ips: &[String]) -> String {
    format!("[{}]", ips.iter().map(|i| format!("{i:?}")).collect::<Vec<_>>().join(" "))
}

fn invalid(field: &str, detail: String) -> Cause {
    Cause { reason: "FieldValueInvalid", message: format!("Invalid value: {detail}"), field: field.into() }
}

fn forbidden(field: &str, detail: &str) -> Cause {
    Cause { reason: "FieldValueForbidden", message: format!("Forbidden: {detail}"), field: field.into() }
}

fn required(field: String) -> Cause {
    Cause { reason: "FieldValueRequired", message: "Required value".into(), field }
}

fn not_supported(field: String, v: &Value, allowed: &[&str]) -> Cause {
    let list: Vec<String> = allowed.iter().map(|a| format!("{a:?}")).collect();
    Cause { reason: "FieldValueNotSupported", message: format!("Unsupported value: {v}: supported values: {}", list.join(", ")), field }
}

/// SetDefaults_Service, as the real server's decoder applies it to every body.
fn defaults(svc: &mut Value) {
    let spec = spec_mut(svc);
    spec.entry("type").or_insert("ClusterIP".into());
    spec.entry("sessionAffinity").or_insert("None".into());
    for p in spec.get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten() {
        if let Some(p) = p.as_object_mut() {
            p.entry("protocol").or_insert("TCP".into());
            let port = p.get("port").cloned().unwrap_or(Value::Null);
            let target = p.entry("targetPort").or_insert(Value::Null);
            if target.is_null() || *target == 0 || *target == "" {
                *target = port;
            }
        }
    }
    let t = spec["type"].as_str().unwrap_or_default().to_owned();
    if matches!(t.as_str(), "LoadBalancer" | "NodePort") {
        spec.entry("externalTrafficPolicy").or_insert("Cluster".into());
    }
    if t != "ExternalName" {
        spec.entry("internalTrafficPolicy").or_insert("Cluster".into());
    }
    if t == "LoadBalancer" {
        spec.entry("allocateLoadBalancerNodePorts").or_insert(true.into());
    }
}

/// `clusterIP` and `clusterIPs` filled from each other (the real server's normalizeClusterIPs).
fn normalize_cluster_ips(old: Option<&Value>, svc: &mut Value) {
    let ip = svc["spec"]["clusterIP"].as_str().unwrap_or("").to_owned();
    let ips = cluster_ips(svc);
    let spec = spec_mut(svc);
    if let Some(old) = old {
        // clusterIP changed alone: clusterIPs follows it.
        if ip != old["spec"]["clusterIP"].as_str().unwrap_or("") && ips == cluster_ips(old) {
            if ip.is_empty() {
                spec.remove("clusterIPs");
            } else {
                spec.insert("clusterIPs".into(), json!([ip]));
            }
            return;
        }
    }
    // Not the other way: clusterIPs without clusterIP is refused (init_families).
    if ips.is_empty() && !ip.is_empty() {
        spec.insert("clusterIPs".into(), json!([ip]));
    }
}

/// The service CIDR of a family (`IPv4`, `IPv6`): network and prefix length.
fn service_cidr(family: &str) -> (IpAddr, u32) {
    match family {
        "IPv6" => (CLUSTER_IP6_NET.into(), CLUSTER_IP6_PREFIX),
        _ => (CLUSTER_IP_NET.into(), CLUSTER_IP_PREFIX),
    }
}

fn family_of(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// An address as a number and its width in bits.
fn bits(ip: IpAddr) -> (u128, u32) {
    match ip {
        IpAddr::V4(a) => (u32::from(a).into(), 32),
        IpAddr::V6(a) => (a.into(), 128),
    }
}

fn in_cluster_range(ip: IpAddr) -> bool {
    let (net, len) = service_cidr(family_of(ip));
    let ((a, width), (n, _)) = (bits(ip), bits(net));
    a >> (width - len) == n >> (width - len)
}

/// The lowest free address of `family`'s service CIDR, above the static band first
/// (KEP-3070: min(max(16, size/16), 256) addresses; 256 for both ranges here).
fn free_cluster_ip(family: &str, used: &Used) -> Result<String, ApiError> {
    let (net, len) = service_cidr(family);
    let (base, width) = bits(net);
    let size = 1u128 << (width - len);
    let at = |i: u128| match net {
        IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::from(u32::try_from(base + i).expect("an IPv4 address"))),
        IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::from(base + i)),
    };
    let band = u128::from(CLUSTER_IP_STATIC_BAND);
    (band..size - 1).chain(1..band).map(|i| at(i).to_string()).find(|a| !used.ips.contains(a)).ok_or_else(|| range_full("clusterIP"))
}

fn families(svc: &Value) -> Vec<String> {
    svc["spec"]["ipFamilies"].as_array().into_iter().flatten().filter_map(Value::as_str).map(str::to_owned).collect()
}

const POLICIES: [&str; 3] = ["PreferDualStack", "RequireDualStack", "SingleStack"];

/// initIPFamilyFields: `ipFamilyPolicy` (SingleStack, or the old one on update) and
/// `ipFamilies` (from `clusterIPs`, else the primary IPv4, plus the other family
/// for a dual-stack policy on a dual-stack cluster) filled in and checked against
/// the cluster's families. A PreferDualStack Service whose addresses and families
/// the request leaves alone is left alone (no upgrade when the cluster changes).
fn init_families(stack: Stack, old: Option<&Value>, svc: &mut Value) -> Vec<Cause> {
    let policy_is = |s: &Value, p: &str| s["spec"]["ipFamilyPolicy"] == p;
    if let Some(o) = old {
        let unchanged = cluster_ips(o) == cluster_ips(svc) && families(o) == families(svc);
        if policy_is(o, "PreferDualStack") && (policy_is(svc, "PreferDualStack") || svc["spec"]["ipFamilyPolicy"].is_null()) && unchanged {
            return Vec::new();
        }
    }
    let policy = match (svc["spec"]["ipFamilyPolicy"].as_str(), old.and_then(|o| o["spec"]["ipFamilyPolicy"].as_str())) {
        (Some(p), _) | (None, Some(p)) => p.to_owned(),
        (None, None) => "SingleStack".to_owned(),
    };
    spec_mut(svc).insert("ipFamilyPolicy".into(), policy.clone().into());
    let mut c = Vec::new();
    // The stand-alone checks first (ValidateServiceClusterIPsRelatedFields).
    if !POLICIES.contains(&policy.as_str()) {
        c.push(not_supported("spec.ipFamilyPolicy".into(), &svc["spec"]["ipFamilyPolicy"], &POLICIES));
    }
    let listed = svc["spec"]["ipFamilies"].as_array().cloned().unwrap_or_default();
    for (i, f) in listed.iter().enumerate() {
        if !matches!(f.as_str(), Some("IPv4" | "IPv6")) {
            c.push(not_supported(format!("spec.ipFamilies[{i}]"), f, &["IPv4", "IPv6"]));
        } else if listed[..i].contains(f) {
            c.push(Cause { reason: "FieldValueDuplicate", message: format!("Duplicate value: {f}"), field: format!("spec.ipFamilies[{i}]") });
        }
    }
    let ips = cluster_ips(svc);
    if !ips.is_empty() && svc["spec"]["clusterIP"].as_str().is_none_or(str::is_empty) {
        c.push(invalid("spec.clusterIPs", format!("{}: must be empty when `clusterIP` is not specified", quoted_list(&ips))));
    }
    let parsed: Vec<IpAddr> = ips.iter().map_while(|ip| ip.parse().ok()).collect();
    if parsed.len() == 2 && parsed[0].is_ipv4() == parsed[1].is_ipv4() {
        c.push(invalid("spec.clusterIPs", format!("{}: may specify no more than one IP for each IP family", quoted_list(&ips))));
    }
    // Each address of the family at its index.
    for (i, (a, f)) in parsed.iter().zip(&listed).enumerate() {
        if f.as_str().is_some_and(|f| f != family_of(*a)) {
            c.push(invalid(
                &format!("spec.clusterIPs[{i}]"),
                format!("\"{a}\": expected an {f} value as indicated by `ipFamilies[{i}]`", f = f.as_str().unwrap_or_default()),
            ));
        }
    }
    if !c.is_empty() {
        return c;
    }
    let quoted = format!("{policy:?}");
    if let Some(o) = old {
        let spec = spec_mut(svc);
        let reduced = |f: &str| {
            let (was, now) = (o["spec"][f].as_array().map_or(0, Vec::len), spec.get(f).and_then(Value::as_array).map_or(0, Vec::len));
            now > 0 && now < was
        };
        if policy == "SingleStack" {
            // Unchanged lists with a SingleStack policy: the secondary goes.
            for f in ["clusterIPs", "ipFamilies"] {
                if spec.get(f) == Some(&o["spec"][f]) {
                    if let Some(list) = spec.get_mut(f).and_then(Value::as_array_mut) {
                        list.truncate(1);
                    }
                }
            }
        } else {
            for (f, what) in [("clusterIPs", "cluster IP"), ("ipFamilies", "IP family")] {
                if reduced(f) {
                    c.push(invalid("spec.ipFamilyPolicy", format!("{quoted}: must be 'SingleStack' to release the secondary {what}")));
                }
            }
        }
    }
    if policy == "SingleStack" {
        for (f, what) in [("clusterIPs", "cluster IPs"), ("ipFamilies", "IP families")] {
            if svc["spec"][f].as_array().is_some_and(|l| l.len() == 2) {
                c.push(invalid("spec.ipFamilyPolicy", format!("{quoted}: must be 'RequireDualStack' or 'PreferDualStack' when multiple {what} are specified")));
            }
        }
    }
    let configured = stack.families();
    // As the update left them.
    let ips = cluster_ips(svc);
    let mut fams = families(svc);
    for (i, ip) in ips.iter().enumerate().take_while(|(_, ip)| *ip != "None") {
        let Ok(a) = ip.parse::<IpAddr>() else { break };
        if i >= fams.len() {
            if configured.contains(&family_of(a)) {
                fams.push(family_of(a).to_owned());
            } else {
                c.push(invalid(&format!("spec.clusterIPs[{i}]"), format!("{}: {} is not configured on this cluster", quoted_list(&ips), family_of(a))));
            }
        }
    }
    if !c.is_empty() {
        return c;
    }
    if policy == "RequireDualStack" && stack != Stack::Dual {
        c.push(invalid("spec.ipFamilyPolicy", format!("{quoted}: this cluster is not configured for dual-stack services")));
    }
    for (i, f) in fams.iter().enumerate() {
        if !configured.contains(&f.as_str()) {
            c.push(invalid(&format!("spec.ipFamilies[{i}]"), format!("{f:?}: not configured on this cluster")));
        }
    }
    if !c.is_empty() {
        return c;
    }
    if fams.is_empty() {
        fams.push(configured[0].into());
    }
    if policy != "SingleStack" && fams.len() == 1 && stack == Stack::Dual {
        fams.push(if fams[0] == "IPv4" { "IPv6" } else { "IPv4" }.into());
    }
    spec_mut(svc).insert("ipFamilies".into(), json!(fams));
    Vec::new()
}

fn range_full(what: &str) -> ApiError {
    internal(format!("failed to allocate a {what}: range is full"))
}

fn internal(message: String) -> ApiError {
    let mut e = ApiError::new(500, "InternalError", format!("Internal error occurred: {message}"));
    e.details = Some(json!({ "causes": [{ "message": message }] }));
    e
}

/// Allocates (or checks the requested) clusterIP, nodePorts and healthCheckNodePort
/// that `svc` needs and `old` (the stored Service, on update) did not already hold.
fn allocate(stack: Stack, name: &str, old: Option<&Value>, svc: &mut Value, used: &Used) -> Result<(), ApiError> {
    let one = |c: Cause| ApiError::invalid_service(name, vec![c]);
    // The families, then a clusterIP of each (a dual-stack upgrade adds the second).
    if needs_cluster_ip(svc) {
        let held = old.filter(|o| needs_cluster_ip(o));
        let causes = init_families(stack, held, svc);
        if !causes.is_empty() {
            return Err(ApiError::invalid_service(name, causes));
        }
        let mut ips = cluster_ips(svc);
        if ips.first().map(String::as_str) != Some("None") {
            let had = held.map(cluster_ips).unwrap_or_default();
            for (i, family) in families(svc).iter().enumerate() {
                match ips.get(i) {
                    // Held already, or unparseable (validation's business).
                    Some(ip) if had.get(i) == Some(ip) => {}
                    Some(ip) => {
                        let Ok(a) = ip.parse::<IpAddr>() else { continue };
                        let fail = |why: &str| one(invalid("spec.clusterIPs", format!("{}: failed to allocate IP {ip}: {why}", quoted_list(&ips))));
                        if !in_cluster_range(a) {
                            return Err(fail("the provided network does not match the current range"));
                        }
                        if used.ips.contains(ip) {
                            return Err(fail("provided IP is already allocated"));
                        }
                    }
                    None => ips.push(free_cluster_ip(family, used)?),
                }
            }
            let spec = spec_mut(svc);
            spec.insert("clusterIP".into(), ips[0].clone().into());
            spec.insert("clusterIPs".into(), json!(ips));
        }
    }
    // nodePorts: requested ones (also on a LoadBalancer that allocates none) are
    // checked, missing ones allocated when needed. Ports the Service held before stay its own.
    let is_free = |p: i64, mine: &[(i64, String, i64)]| !used.ports.contains(&p) && mine.iter().all(|m| m.2 != p);
    let next_free =
        |mine: &[(i64, String, i64)]| (NODE_PORTS_DYNAMIC..=*NODE_PORTS.end()).chain(*NODE_PORTS.start()..NODE_PORTS_DYNAMIC).find(|p| is_free(*p, mine));
    let mut mine: Vec<(i64, String, i64)> = Vec::new();
    if externally_accessible(svc) {
        let needs = needs_node_ports(svc);
        let list = ports(svc).to_vec();
        let mut assigned = Vec::with_capacity(list.len());
        for (i, p) in list.iter().enumerate() {
            let (port, proto) = (p["port"].as_i64().unwrap_or(0), p["protocol"].as_str().unwrap_or("TCP").to_owned());
            let field = format!("spec.ports[{i}].nodePort");
            let np = match set_int(&p["nodePort"]) {
                Some(np) => {
                    if !NODE_PORTS.contains(&np) {
                        let (lo, hi) = (NODE_PORTS.start(), NODE_PORTS.end());
                        return Err(one(invalid(&field, format!("{np}: provided port is not in the valid range. The range of valid ports is {lo}-{hi}"))));
                    }
                    // One nodePort may serve the same port number over two protocols.
                    let shared = mine.iter().any(|m| m.2 == np && m.0 == port && m.1 != proto);
                    if !shared && !is_free(np, &mine) {
                        return Err(one(invalid(&field, format!("{np}: provided port is already allocated"))));
                    }
                    Some(np)
                }
                None if needs => match mine.iter().find(|m| m.0 == port) {
                    Some(m) => Some(m.2),
                    None => Some(next_free(&mine).ok_or_else(|| range_full("nodePort"))?),
                },
                None => None,
            };
            if let Some(np) = np {
                mine.push((port, proto, np));
            }
            assigned.push(np);
        }
        for (p, np) in spec_mut(svc).get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten().zip(assigned) {
            if let (Some(np), Some(p)) = (np, p.as_object_mut()) {
                p.insert("nodePort".into(), np.into());
            }
        }
    }
    // healthCheckNodePort, when newly needed.
    if needs_hcnp(svc) && old.is_none_or(|o| !needs_hcnp(o)) {
        let hc = match set_int(&svc["spec"]["healthCheckNodePort"]) {
            Some(hc) => {
                let why = if !NODE_PORTS.contains(&hc) {
                    Some(format!("provided port is not in the valid range. The range of valid ports is {}-{}", NODE_PORTS.start(), NODE_PORTS.end()))
                } else if !is_free(hc, &mine) {
                    Some("provided port is already allocated".to_owned())
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(internal(format!("failed to allocate requested HealthCheck NodePort {hc}: {why}")));
                }
                hc
            }
            None => next_free(&mine).ok_or_else(|| range_full("healthCheckNodePort"))?,
        };
        spec_mut(svc).insert("healthCheckNodePort".into(), hc.into());
    }
    Ok(())
}

/// ValidateService (the parts above), and ValidateServiceUpdate with `old`.
fn validate(old: Option<&Value>, svc: &Value) -> Vec<Cause> {
    let mut c = Vec::new();
    let spec = &svc["spec"];
    let t = ty(svc);
    const TYPES: [&str; 4] = ["ClusterIP", "ExternalName", "LoadBalancer", "NodePort"];
    if !TYPES.contains(&t) {
        c.push(not_supported("spec.type".into(), &spec["type"], &TYPES));
    }
    let list = ports(svc);
    if t != "ExternalName" && list.is_empty() {
        c.push(required("spec.ports".into()));
    }
    let mut names = BTreeSet::new();
    for (i, p) in list.iter().enumerate() {
        let at = |f: &str| format!("spec.ports[{i}].{f}");
        let name = p["name"].as_str().unwrap_or("");
        if list.len() > 1 && name.is_empty() {
            c.push(required(at("name")));
        } else if !name.is_empty() && !names.insert(name) {
            c.push(Cause { reason: "FieldValueDuplicate", message: format!("Duplicate value: {:?}", name), field: at("name") });
        }
        let port_ok = |v: &Value| v.as_i64().is_some_and(|n| (1..=65535).contains(&n));
        if !port_ok(&p["port"]) {
            c.push(invalid(&at("port"), format!("{}: must be between 1 and 65535, inclusive", p["port"])));
        }
        const PROTOCOLS: [&str; 3] = ["SCTP", "TCP", "UDP"];
        if !p["protocol"].as_str().is_some_and(|pr| PROTOCOLS.contains(&pr)) {
            c.push(not_supported(at("protocol"), &p["protocol"], &PROTOCOLS));
        }
        if p["targetPort"].is_number() && !port_ok(&p["targetPort"]) {
            c.push(invalid(&at("targetPort"), format!("{}: must be between 1 and 65535, inclusive", p["targetPort"])));
        }
        if t == "ClusterIP" && set_int(&p["nodePort"]).is_some() {
            c.push(forbidden(&at("nodePort"), "may not be used when `type` is 'ClusterIP'"));
        }
    }
    let ips = cluster_ips(svc);
    let ip = spec["clusterIP"].as_str().unwrap_or("");
    if t == "ExternalName" {
        if !ips.is_empty() || !ip.is_empty() {
            c.push(forbidden("spec.clusterIPs", "may not be set for ExternalName services"));
        }
        if spec["externalName"].as_str().is_none_or(str::is_empty) {
            c.push(required("spec.externalName".into()));
        }
    } else {
        let first = ips.first().map(String::as_str);
        if first.is_some_and(|f| !ip.is_empty() && f != ip) {
            // Only this is reported then (as by the real server), not the change below.
            c.push(invalid("spec.clusterIPs", format!("{}: first value must match `clusterIP`", quoted_list(&ips))));
        } else if old.is_some_and(|o| needs_cluster_ip(o) && cluster_ips(o).first().map(String::as_str) != first) {
            c.push(invalid("spec.clusterIPs[0]", format!("{}: may not change once set", quoted_list(&ips))));
        }
        match first {
            Some("None") if matches!(t, "LoadBalancer" | "NodePort") => {
                c.push(invalid("spec.clusterIPs[0]", format!("\"None\": may not be set to 'None' for {t} services")));
            }
            Some(f) if f != "None" && f.parse::<std::net::IpAddr>().is_err() => {
                c.push(invalid("spec.clusterIPs[0]", format!("{f:?}: {VALID_IP}")));
            }
            _ => {}
        }
    }
    if let Some(hc) = set_int(&spec["healthCheckNodePort"]) {
        if !needs_hcnp(svc) {
            c.push(invalid("spec.healthCheckNodePort", format!("{hc}: may only be set when `type` is 'LoadBalancer' and `externalTrafficPolicy` is 'Local'")));
        } else if old.is_some_and(|o| needs_hcnp(o) && o["spec"]["healthCheckNodePort"] != spec["healthCheckNodePort"]) {
            c.push(forbidden("spec.healthCheckNodePort", "field is immutable"));
        }
    }
    match &spec["externalTrafficPolicy"] {
        Value::Null => {}
        etp if !externally_accessible(svc) => {
            c.push(invalid("spec.externalTrafficPolicy", format!("{etp}: may only be set for externally-accessible services")))
        }
        etp if !matches!(etp.as_str(), Some("Cluster" | "Local")) => c.push(not_supported("spec.externalTrafficPolicy".into(), etp, &["Cluster", "Local"])),
        _ => {}
    }
    if !spec["allocateLoadBalancerNodePorts"].is_null() && t != "LoadBalancer" {
        c.push(forbidden("spec.allocateLoadBalancerNodePorts", "may only be used when `type` is 'LoadBalancer'"));
    }
    let class = &spec["loadBalancerClass"];
    if !class.is_null() && t != "LoadBalancer" {
        c.push(forbidden("spec.loadBalancerClass", "may only be used when `type` is 'LoadBalancer'"));
    }
    if let Some(o) = old.filter(|o| is_lb(o) && t == "LoadBalancer") {
        if o["spec"]["loadBalancerClass"] != *class {
            c.push(invalid("spec.loadBalancerClass", format!("{class}: may not change once set")));
        }
    }
    c
}

/// What a create stores of a Service (status already dropped), or why not.
pub(super) fn prepare_create(stack: Stack, name: &str, svc: &mut Value, used: &Used) -> Result<(), ApiError> {
    defaults(svc);
    normalize_cluster_ips(None, svc);
    let unparseable = cluster_ips(svc).first().is_some_and(|ip| ip != "None" && ip.parse::<IpAddr>().is_err());
    if !unparseable {
        allocate(stack, name, None, svc, used)?;
    }
    let causes = validate(None, svc);
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_service(name, causes))
    }
}

/// Adjusts and checks `new` (the Service as it will be stored) against `old`.
pub(super) fn prepare_update(stack: Stack, old: &Value, new: &mut Value, part: Part, used: &Used) -> Result<(), ApiError> {
    let name = new["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    if part == Part::Status {
        let ingress = new["status"]["loadBalancer"]["ingress"].as_array().cloned().unwrap_or_default();
        if !is_lb(new) && !ingress.is_empty() {
            let c = forbidden("status.loadBalancer.ingress", "may only be used when `spec.type` is 'LoadBalancer'");
            return Err(ApiError::invalid_service(&name, vec![c]));
        }
        // Any address of either family (the server does not hold it to `ipFamilies`).
        let causes: Vec<Cause> = ingress
            .iter()
            .enumerate()
            .filter_map(|(i, g)| {
                let ip = g["ip"].as_str()?;
                ip.parse::<IpAddr>().is_err().then(|| invalid(&format!("status.loadBalancer.ingress[{i}].ip"), format!("{ip:?}: {VALID_IP}")))
            })
            .collect();
        if !causes.is_empty() {
            return Err(ApiError::invalid_service(&name, causes));
        }
        return Ok(());
    }
    defaults(new);
    keep_allocated(old, new);
    normalize_cluster_ips(Some(old), new);
    drop_type_dependent(old, new, part);
    let causes = validate(Some(old), new);
    if !causes.is_empty() {
        return Err(ApiError::invalid_service(&name, causes));
    }
    allocate(stack, &name, Some(old), new, used)
}

/// patchAllocatedValues: what the request left out keeps the value the Service holds.
fn keep_allocated(old: &Value, new: &mut Value) {
    if needs_cluster_ip(old) && needs_cluster_ip(new) {
        let spec = spec_mut(new);
        for f in ["clusterIP", "clusterIPs"] {
            let missing = spec.get(f).is_none_or(|v| v.is_null() || *v == "" || v.as_array().is_some_and(Vec::is_empty));
            if missing && !old["spec"][f].is_null() {
                spec.insert(f.into(), old["spec"][f].clone());
            }
        }
    }
    if needs_node_ports(old) && needs_node_ports(new) {
        // By port name, unless another port of the new spec uses it.
        let taken: BTreeSet<i64> = ports(new).iter().filter_map(|p| set_int(&p["nodePort"])).collect();
        let by_name: Vec<(String, i64)> =
            ports(old).iter().filter_map(|p| Some((p["name"].as_str().unwrap_or("").to_owned(), set_int(&p["nodePort"])?))).collect();
        for p in spec_mut(new).get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten() {
            let name = p["name"].as_str().unwrap_or("").to_owned();
            if set_int(&p["nodePort"]).is_none() {
                if let Some((_, np)) = by_name.iter().find(|(n, np)| *n == name && !taken.contains(np)) {
                    p["nodePort"] = (*np).into();
                }
            }
        }
    }
    if needs_hcnp(old) && needs_hcnp(new) && set_int(&new["spec"]["healthCheckNodePort"]).is_none() {
        spec_mut(new).insert("healthCheckNodePort".into(), old["spec"]["healthCheckNodePort"].clone());
    }
}

/// dropTypeDependentFields: a type or policy change drops what the new one has no use
/// for, when the request left it as it was (a changed value is validated instead).
fn drop_type_dependent(old: &Value, new: &mut Value, part: Part) {
    let same = |new: &Value, f: &str| new["spec"][f] == old["spec"][f];
    if needs_cluster_ip(old) && !needs_cluster_ip(new) && same(new, "clusterIPs") {
        let spec = spec_mut(new);
        for f in ["clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"] {
            spec.remove(f);
        }
    }
    if needs_node_ports(old) && !needs_node_ports(new) {
        let nps = |s: &Value| ports(s).iter().map(|p| p["nodePort"].clone()).collect::<Vec<_>>();
        if nps(new) == nps(old) {
            for p in spec_mut(new).get_mut("ports").and_then(Value::as_array_mut).into_iter().flatten() {
                if let Some(p) = p.as_object_mut() {
                    p.remove("nodePort");
                }
            }
        }
    }
    if needs_hcnp(old) && !needs_hcnp(new) && same(new, "healthCheckNodePort") {
        spec_mut(new).remove("healthCheckNodePort");
    }
    if !externally_accessible(new) && same(new, "externalTrafficPolicy") {
        spec_mut(new).remove("externalTrafficPolicy");
    }
    if ty(new) == "ExternalName" && same(new, "internalTrafficPolicy") {
        spec_mut(new).remove("internalTrafficPolicy");
    }
    if !is_lb(new) {
        for f in ["allocateLoadBalancerNodePorts", "loadBalancerClass"] {
            if same(new, f) {
                spec_mut(new).remove(f);
            }
        }
    }
    // Away from LoadBalancer the real server clears the addresses it had.
    if part == Part::Main && is_lb(old) && !is_lb(new) && new["status"].is_object() {
        new["status"]["loadBalancer"] = json!({});
    }
}
