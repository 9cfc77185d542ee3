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
//! - families, as on a cluster with one (IPv4) service CIDR: `ipFamilyPolicy` one
//!   of SingleStack (the default), PreferDualStack (kept, with `ipFamilies`
//!   `[IPv4]`) or RequireDualStack (refused: no dual-stack here), `ipFamilies`
//!   IPv4 (IPv6 refused: not configured), SingleStack with two families refused;
//! - the status subresource: `status.loadBalancer.ingress` only for LoadBalancers.
//!
//! Allocated values are derived from the stored Services, so deleting a Service
//! frees them at once (the real allocators' repair loop takes minutes).
use std::{collections::BTreeSet, net::Ipv4Addr, ops::RangeInclusive};

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
/// Dynamic clusterIPs start above the static band (KEP-3070: min(max(16, size/16), 256) addresses).
const CLUSTER_IP_STATIC_BAND: u32 = 256;

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
    if ips.is_empty() && !ip.is_empty() {
        spec.insert("clusterIPs".into(), json!([ip]));
    } else if ip.is_empty() && !ips.is_empty() {
        spec.insert("clusterIP".into(), ips[0].clone().into());
    }
}

fn in_cluster_range(ip: Ipv4Addr) -> bool {
    u32::from(ip) >> (32 - CLUSTER_IP_PREFIX) == u32::from(CLUSTER_IP_NET) >> (32 - CLUSTER_IP_PREFIX)
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
fn allocate(name: &str, old: Option<&Value>, svc: &mut Value, used: &Used) -> Result<(), ApiError> {
    let one = |c: Cause| ApiError::invalid_service(name, vec![c]);
    // clusterIP, when newly needed.
    if needs_cluster_ip(svc) && old.is_none_or(|o| !needs_cluster_ip(o)) {
        let ips = cluster_ips(svc);
        match ips.first().map(String::as_str) {
            Some("None") => {}
            Some(ip) => {
                // An unparseable one is validation's business.
                if let Ok(a) = ip.parse::<Ipv4Addr>() {
                    let fail = |why: &str| one(invalid("spec.clusterIPs", format!("{}: failed to allocate IP {ip}: {why}", quoted_list(&ips))));
                    if !in_cluster_range(a) {
                        return Err(fail("the provided network does not match the current range"));
                    }
                    if used.ips.contains(ip) {
                        return Err(fail("provided IP is already allocated"));
                    }
                }
            }
            None => {
                let base = u32::from(CLUSTER_IP_NET);
                let size = 1u32 << (32 - CLUSTER_IP_PREFIX);
                let free = (CLUSTER_IP_STATIC_BAND..size - 1)
                    .chain(1..CLUSTER_IP_STATIC_BAND)
                    .map(|i| Ipv4Addr::from(base + i).to_string())
                    .find(|a| !used.ips.contains(a))
                    .ok_or_else(|| range_full("clusterIP"))?;
                let spec = spec_mut(svc);
                spec.insert("clusterIP".into(), free.clone().into());
                spec.insert("clusterIPs".into(), json!([free]));
            }
        }
        if svc["spec"]["clusterIP"].as_str().is_some_and(|ip| ip.parse::<Ipv4Addr>().is_ok()) {
            let spec = spec_mut(svc);
            spec.entry("ipFamilies").or_insert(json!(["IPv4"]));
            spec.entry("ipFamilyPolicy").or_insert("SingleStack".into());
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
    // The families, on the tests' IPv4-only cluster (one service CIDR).
    const POLICIES: [&str; 3] = ["PreferDualStack", "RequireDualStack", "SingleStack"];
    let before = c.len();
    match spec["ipFamilyPolicy"].as_str() {
        None => {}
        Some(p) if !POLICIES.contains(&p) => c.push(not_supported("spec.ipFamilyPolicy".into(), &spec["ipFamilyPolicy"], &POLICIES)),
        Some("RequireDualStack") => {
            c.push(invalid("spec.ipFamilyPolicy", "\"RequireDualStack\": this cluster is not configured for dual-stack services".into()))
        }
        Some("SingleStack") if spec["ipFamilies"].as_array().is_some_and(|f| f.len() > 1) => c.push(invalid(
            "spec.ipFamilyPolicy",
            "\"SingleStack\": must be 'RequireDualStack' or 'PreferDualStack' when multiple IP families are specified".into(),
        )),
        Some(_) => {}
    }
    for (i, f) in spec["ipFamilies"].as_array().into_iter().flatten().enumerate() {
        match f.as_str() {
            Some("IPv4") => {}
            // The real server checks the configured families after the policy.
            Some("IPv6") if c.len() > before => {}
            Some("IPv6") => c.push(invalid(&format!("spec.ipFamilies[{i}]"), "\"IPv6\": not configured on this cluster".into())),
            _ => c.push(not_supported(format!("spec.ipFamilies[{i}]"), f, &["IPv4", "IPv6"])),
        }
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
                c.push(invalid("spec.clusterIPs[0]", format!("{f:?}: must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)")));
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
pub(super) fn prepare_create(name: &str, svc: &mut Value, used: &Used) -> Result<(), ApiError> {
    defaults(svc);
    normalize_cluster_ips(None, svc);
    let unparseable = cluster_ips(svc).first().is_some_and(|ip| ip != "None" && ip.parse::<Ipv4Addr>().is_err());
    if !unparseable {
        allocate(name, None, svc, used)?;
    }
    let causes = validate(None, svc);
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid_service(name, causes))
    }
}

/// Adjusts and checks `new` (the Service as it will be stored) against `old`.
pub(super) fn prepare_update(old: &Value, new: &mut Value, part: Part, used: &Used) -> Result<(), ApiError> {
    let name = new["metadata"]["name"].as_str().unwrap_or_default().to_owned();
    if part == Part::Status {
        if !is_lb(new) && new["status"]["loadBalancer"]["ingress"].as_array().is_some_and(|i| !i.is_empty()) {
            let c = forbidden("status.loadBalancer.ingress", "may only be used when `spec.type` is 'LoadBalancer'");
            return Err(ApiError::invalid_service(&name, vec![c]));
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
    allocate(&name, Some(old), new, used)
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
