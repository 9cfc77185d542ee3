//! VipPools checked together: each pool's spec on its own (field paths), then
//! overlaps between pools (the older pool keeps its addresses; the newer one is
//! `Conflicting`), and the status conditions that say so.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};

use super::crd::{validate, ValidPool, VipPool};
use crate::addrs::AddrSet;

/// One pool's verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct PoolCheck {
    pub name: String,
    /// The pool in use (None when its spec is invalid or it overlaps an older pool).
    pub valid: Option<ValidPool>,
    /// Why it is not in use: (reason, message with the field path).
    pub problem: Option<(String, String)>,
}

/// Checks every pool. Pools are taken oldest first
/// (then by name), so an overlap always blames the pool that came later.
pub fn check_pools(pools: &[VipPool]) -> Vec<PoolCheck> {
    let mut order: Vec<&VipPool> = pools.iter().collect();
    order.sort_by_key(|p| (p.metadata.creation_timestamp.as_ref().map(|t| t.0), p.metadata.name.clone()));
    // The pools in use so far, whose ranges a later pool must not meet.
    let mut taken: Vec<(String, AddrSet)> = Vec::new();
    let mut out = Vec::new();
    for p in order {
        let name = p.metadata.name.clone().unwrap_or_default();
        match validate(&p.spec, 80) {
            Err(e) => out.push(PoolCheck { name, valid: None, problem: Some(("InvalidSpec".into(), e.to_string())) }),
            Ok(v) => {
                if let Some((a, other)) = taken.iter().find_map(|(o, set)| Some((set.first_common(&v.addresses)?, o.clone()))) {
                    let msg = format!("spec.addresses: {a} is also in VipPool {other:?}; pools must not overlap");
                    out.push(PoolCheck { name, valid: None, problem: Some(("Overlap".into(), msg)) });
                    continue;
                }
                taken.push((name.clone(), v.addresses.clone()));
                out.push(PoolCheck { name, valid: Some(v), problem: None });
            }
        }
    }
    out
}

/// Up to three items, then how many more.
pub fn some_of(items: &[String]) -> String {
    let shown: Vec<&str> = items.iter().take(3).map(String::as_str).collect();
    let more = if items.len() > 3 { format!(" (and {} more)", items.len() - 3) } else { String::new() };
    format!("{}{more}", shown.join("; "))
}

/// The `Ready`, `Conflicting`, `Programmed` and `StaleAllocations` conditions for a
/// pool's status. `unprogrammed`: the pool's service-ports the data path could not
/// take (as the leader's agent reports them, "VIP port/proto: why"). `stale`: the
/// Services that keep an address of the pool its selectors no longer admit
/// ("namespace/name VIP"). A condition's `lastTransitionTime` is kept from
/// `previous` when its status did not change.
pub fn conditions(check: &PoolCheck, unprogrammed: &[String], stale: &[String], generation: Option<i64>, previous: &[Condition], now: Time) -> Vec<Condition> {
    let (ready, conflicting) = match &check.problem {
        None => (("True", "Valid", "the pool is valid and in use".to_owned()), ("False", "NoConflict", "no overlap and no bad entry".to_owned())),
        Some((reason, msg)) => (("False", reason.as_str(), msg.clone()), ("True", reason.as_str(), msg.clone())),
    };
    let programmed = match unprogrammed {
        [] => ("True", "AllProgrammed", "every service-port of the pool is in the data path".to_owned()),
        some => ("False", "CapacityExceeded", format!("{} service-port(s) not programmed, retried: {}", some.len(), some_of(some))),
    };
    let stale = match stale {
        [] => ("False", "AllAdmitted", "every Service with an address of the pool is admitted by its selectors".to_owned()),
        some => (
            "True",
            "SelectorsChanged",
            format!("{} Service(s) keep an address the pool's selectors no longer admit (kept, not moved): {}", some.len(), some_of(some)),
        ),
    };
    use super::reports::{CONFLICTING, PROGRAMMED, READY, STALE_ALLOCATIONS};
    [(READY, ready), (CONFLICTING, conflicting), (PROGRAMMED, (programmed.0, programmed.1, programmed.2)), (STALE_ALLOCATIONS, stale)]
        .into_iter()
        .map(|(type_, (status, reason, message))| condition(type_, status, reason, message, generation, previous, &now))
        .collect()
}

/// One condition; its `lastTransitionTime` is kept from `previous` when its status
/// did not change.
pub fn condition(type_: &str, status: &str, reason: &str, message: String, generation: Option<i64>, previous: &[Condition], now: &Time) -> Condition {
    let since = previous.iter().find(|c| c.type_ == type_ && c.status == status).map_or_else(|| now.clone(), |c| c.last_transition_time.clone());
    Condition { type_: type_.into(), status: status.into(), reason: reason.into(), message, observed_generation: generation, last_transition_time: since }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

    use super::*;

    fn pool(name: &str, t: i64, yaml: &str) -> VipPool {
        let mut p = VipPool::new(name, serde_yaml_ng::from_str(yaml).unwrap());
        p.metadata = ObjectMeta {
            name: Some(name.into()),
            creation_timestamp: Some(Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + t).unwrap())),
            generation: Some(3),
            ..Default::default()
        };
        p
    }

    #[test]
    fn overlap_blames_the_newer_pool_and_bad_specs_name_the_field() {
        let pools = [
            pool("newer", 5, "addresses: [198.18.1.10-198.18.1.20]\n"),
            pool("older", 1, "addresses: [198.18.1.8/30]\n"),
            pool("broken", 2, "addresses: [198.18.2.1, 198.18.2.300]\n"),
        ];
        let c = check_pools(&pools);
        assert_eq!(c.iter().map(|x| x.name.as_str()).collect::<Vec<_>>(), ["older", "broken", "newer"]);
        assert!(c[0].valid.is_some() && c[0].problem.is_none());
        assert_eq!(c[1].problem.as_ref().unwrap().0, "InvalidSpec");
        assert!(c[1].problem.as_ref().unwrap().1.starts_with("spec.addresses[1]: "), "{:?}", c[1].problem);
        let (reason, msg) = c[2].problem.clone().unwrap();
        assert_eq!(reason, "Overlap");
        assert_eq!(msg, "spec.addresses: 198.18.1.10 is also in VipPool \"older\"; pools must not overlap");
    }

    /// A bad interface name makes the pool invalid, its `Ready` condition naming the
    /// item, and leaves its addresses to others.
    #[test]
    fn bad_interface_names_make_the_pool_invalid() {
        let pools = [
            pool("ifaces", 1, "addresses: [198.18.1.10]\ninterfaces: [eth0, eth0]\n"),
            pool("later", 2, "addresses: [198.18.1.10]\ninterfaces: [eth1, ens4]\n"),
        ];
        let c = check_pools(&pools);
        let (reason, msg) = c[0].problem.clone().unwrap();
        assert_eq!((reason.as_str(), msg.as_str()), ("InvalidSpec", "spec.interfaces[1]: \"eth0\" is already listed at spec.interfaces[0]"));
        assert_eq!(c[1].valid.as_ref().map(|v| v.interfaces.clone()), Some(vec!["eth1".to_owned(), "ens4".to_owned()]), "{:?}", c[1]);
        let ready = &conditions(&c[0], &[], &[], Some(3), &[], Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap()))[0];
        assert_eq!((ready.type_.as_str(), ready.status.as_str(), ready.reason.as_str()), ("Ready", "False", "InvalidSpec"));
        assert_eq!(ready.message, msg);
        // Into the model: only the valid pool, with its interfaces.
        let w = crate::k8s::source::world_from(&[], &pools, &[], &[], &crate::model::World::default());
        assert_eq!(w.pools.iter().map(|p| (p.name.as_str(), p.interfaces.clone())).collect::<Vec<_>>(), [("later", vec!["eth1".into(), "ens4".into()])]);
    }

    #[test]
    fn conditions_keep_their_transition_time() {
        let t0 = Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_000).unwrap());
        let t1 = Time(k8s_openapi::jiff::Timestamp::from_second(1_700_000_100).unwrap());
        let ok = PoolCheck { name: "p".into(), valid: None, problem: None };
        let first = conditions(&ok, &[], &[], Some(3), &[], t0.clone());
        assert_eq!((first[0].type_.as_str(), first[0].status.as_str()), ("Ready", "True"));
        assert_eq!((first[1].type_.as_str(), first[1].status.as_str()), ("Conflicting", "False"));
        let again = conditions(&ok, &[], &[], Some(4), &first, t1.clone());
        assert_eq!(again[0].last_transition_time, t0, "unchanged status keeps its time");
        assert_eq!(again[0].observed_generation, Some(4));
        let bad = PoolCheck { problem: Some(("Overlap".into(), "spec.addresses: ...".into())), ..ok.clone() };
        let flipped = conditions(&bad, &[], &[], Some(5), &again, t1.clone());
        assert_eq!((flipped[0].status.as_str(), flipped[0].last_transition_time.clone()), ("False", t1.clone()));
        assert_eq!(flipped[1].message, "spec.addresses: ...");
        assert_eq!((first[2].type_.as_str(), first[2].status.as_str()), ("Programmed", "True"));
        let full: Vec<String> = (0..5).map(|i| format!("198.18.1.{i} 80/tcp: lb4_ring is full")).collect();
        let c = conditions(&ok, &full, &[], Some(5), &first, t1.clone());
        assert_eq!((c[2].status.as_str(), c[2].reason.as_str()), ("False", "CapacityExceeded"));
        assert_eq!(c[2].message, "5 service-port(s) not programmed, retried: 198.18.1.0 80/tcp: lb4_ring is full; 198.18.1.1 80/tcp: lb4_ring is full; 198.18.1.2 80/tcp: lb4_ring is full (and 2 more)");
        assert_eq!(c[0].last_transition_time, t0, "Ready did not change");
        assert_eq!((first[3].type_.as_str(), first[3].status.as_str()), ("StaleAllocations", "False"));
        let c = conditions(&ok, &[], &["shop/web 198.18.1.10".to_owned()], Some(5), &first, t1.clone());
        assert_eq!((c[3].status.as_str(), c[3].reason.as_str()), ("True", "SelectorsChanged"));
        assert_eq!(c[3].message, "1 Service(s) keep an address the pool's selectors no longer admit (kept, not moved): shop/web 198.18.1.10");
    }
}
