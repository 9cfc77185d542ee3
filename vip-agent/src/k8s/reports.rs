//! What vip tells the cluster, in one place: the status conditions it writes
//! (on VipPools and VipStatuses) and the Events it records (on Services and
//! VipPools), each with what it means. The writers take the condition types and
//! Events from here, docs/reference/status.md is generated from here
//! (`reference::status_md`), and the tests below check that the condition
//! builders write nothing else and that the CRDs' descriptions name every type.
use kube::runtime::events::{Event, EventType};

/// The kind of object a condition or an Event is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Object {
    VipPool,
    VipStatus,
    Service,
}

impl Object {
    pub fn name(self) -> &'static str {
        match self {
            Object::VipPool => "VipPool",
            Object::VipStatus => "VipStatus",
            Object::Service => "Service",
        }
    }
}

/// The condition types.
pub const READY: &str = "Ready";
pub const CONFLICTING: &str = "Conflicting";
pub const PROGRAMMED: &str = "Programmed";
pub const STALE_ALLOCATIONS: &str = "StaleAllocations";
pub const HELD: &str = "Held";
pub const ARP_CONFLICT: &str = "ArpConflict";

/// One value a condition takes: its status, its reason, and what it means.
#[derive(Clone, Copy, Debug)]
pub struct ConditionState {
    pub status: &'static str,
    pub reason: &'static str,
    pub meaning: &'static str,
    /// The heading of docs/operations/troubleshooting.md that says what to do (its anchor).
    pub troubleshooting: Option<&'static str>,
}

/// A condition type vip writes on `object`, with every value it writes.
#[derive(Clone, Copy, Debug)]
pub struct ConditionDef {
    pub object: Object,
    pub type_: &'static str,
    /// What the condition says, and who writes it when.
    pub about: &'static str,
    pub states: &'static [ConditionState],
}

const fn state(status: &'static str, reason: &'static str, meaning: &'static str, troubleshooting: Option<&'static str>) -> ConditionState {
    ConditionState { status, reason, meaning, troubleshooting }
}

/// Every condition vip writes, VipPool's first, in the order they are written.
pub const CONDITIONS: &[ConditionDef] = &[
    ConditionDef {
        object: Object::VipPool,
        type_: READY,
        about: "the spec is valid and the pool in use",
        states: &[
            state("True", "Valid", "the pool is valid and in use", None),
            state("False", "InvalidSpec", "a field is wrong; the message names it (`spec.addresses[1]: ...`)", Some("readyfalse-invalidspec")),
            state("False", "Overlap", "an address is also in an older pool; this pool is not used", Some("readyfalse-overlap")),
        ],
    },
    ConditionDef {
        object: Object::VipPool,
        type_: CONFLICTING,
        about: "the pool overlaps another or has bad entries: `Ready`'s problem seen from the other side",
        states: &[
            state("False", "NoConflict", "no overlap and no bad entry", None),
            state("True", "InvalidSpec", "as `Ready=False` (InvalidSpec)", Some("readyfalse-invalidspec")),
            state("True", "Overlap", "as `Ready=False` (Overlap)", Some("readyfalse-overlap")),
        ],
    },
    ConditionDef {
        object: Object::VipPool,
        type_: PROGRAMMED,
        about: "every service-port of the pool is in the data path",
        states: &[
            state("True", "AllProgrammed", "every service-port of the pool is in the data path", None),
            state(
                "False",
                "CapacityExceeded",
                "some service-ports did not fit the data path's tables (the message names them); they are retried",
                Some("programmedfalse-capacityexceeded"),
            ),
        ],
    },
    ConditionDef {
        object: Object::VipPool,
        type_: STALE_ALLOCATIONS,
        about: "Services keep addresses of the pool its selectors no longer admit: an edited pool does not take a running Service's address",
        states: &[
            state("False", "AllAdmitted", "every Service with an address of the pool is admitted by its selectors", None),
            state(
                "True",
                "SelectorsChanged",
                "some Services keep an address the selectors no longer admit (kept, not moved; the message names them)",
                Some("staleallocationstrue-selectorschanged"),
            ),
        ],
    },
    ConditionDef {
        object: Object::VipPool,
        type_: HELD,
        about: "every VIP of the pool in use is held (answered) by a node",
        states: &[
            state("True", "AllHeld", "every VIP of the pool in use is held by a node", None),
            state(
                "False",
                "NoHolder",
                "some VIPs in use are answered by no node; the message names them and why (no node may hold the pool, with the nodes left out and their reason; or none of its eligible nodes is alive)",
                Some("heldfalse-noholder"),
            ),
        ],
    },
    ConditionDef {
        object: Object::VipStatus,
        type_: HELD,
        about: "a node holds the VIP: written by the holder while it holds it, by the elected agent while none does",
        states: &[
            state("True", "Held", "a node holds the VIP; the message names it, its interface and VLAN", None),
            state("False", "NoHolder", "no node holds the VIP; the message says why (as the pool's `Held=False`)", Some("heldfalse-noholder")),
        ],
    },
    ConditionDef {
        object: Object::VipStatus,
        type_: ARP_CONFLICT,
        about: "what the last ARP self-check of the VIP by a peer saw, written by the holder; absent until a peer has checked (a VIP whose pool has a single node is never checked)",
        states: &[
            state(
                "True",
                "ForeignAnswer",
                "a MAC other than the holder's answered the peer's ARP request; the message names the MACs and the node that asked",
                Some("arpconflicttrue-foreignanswer"),
            ),
            state("False", "HolderOnly", "only the holder's MAC answered", None),
            state("Unknown", "NoAnswer", "nothing answered the peer's ARP request, not even the holder", Some("arpconflicttrue-foreignanswer")),
        ],
    },
];

/// The condition types written on `object`, each once, in order.
pub fn condition_types(object: Object) -> Vec<&'static str> {
    let mut out: Vec<&'static str> = Vec::new();
    for c in CONDITIONS.iter().filter(|c| c.object == object) {
        if !out.contains(&c.type_) {
            out.push(c.type_);
        }
    }
    out
}

/// Every Event vip records (by the elected agent).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventReason {
    Allocated,
    Released,
    OwnerChanged,
    AllocationFailed,
    StaleAllocation,
    MetalLBAnnotation,
    NotProgrammed,
    NotHeld,
    Held,
    ArpConflict,
    ArpConflictResolved,
    Invalid,
}

impl EventReason {
    pub const ALL: [EventReason; 12] = [
        EventReason::Allocated,
        EventReason::Released,
        EventReason::OwnerChanged,
        EventReason::AllocationFailed,
        EventReason::StaleAllocation,
        EventReason::MetalLBAnnotation,
        EventReason::NotProgrammed,
        EventReason::NotHeld,
        EventReason::Held,
        EventReason::ArpConflict,
        EventReason::ArpConflictResolved,
        EventReason::Invalid,
    ];

    /// The Event's reason, as `kubectl describe` shows it.
    pub fn name(self) -> &'static str {
        match self {
            EventReason::Allocated => "Allocated",
            EventReason::Released => "Released",
            EventReason::OwnerChanged => "OwnerChanged",
            EventReason::AllocationFailed => "AllocationFailed",
            EventReason::StaleAllocation => "StaleAllocation",
            EventReason::MetalLBAnnotation => "MetalLBAnnotation",
            EventReason::NotProgrammed => "NotProgrammed",
            EventReason::NotHeld => "NotHeld",
            EventReason::Held => "Held",
            EventReason::ArpConflict => "ArpConflict",
            EventReason::ArpConflictResolved => "ArpConflictResolved",
            EventReason::Invalid => "Invalid",
        }
    }

    /// Normal, or Warning (something to act on).
    pub fn warning(self) -> bool {
        matches!(
            self,
            EventReason::AllocationFailed
                | EventReason::StaleAllocation
                | EventReason::MetalLBAnnotation
                | EventReason::NotProgrammed
                | EventReason::NotHeld
                | EventReason::ArpConflict
                | EventReason::Invalid
        )
    }

    /// The object it is recorded on.
    pub fn object(self) -> Object {
        match self {
            EventReason::Invalid => Object::VipPool,
            _ => Object::Service,
        }
    }

    /// The Event's action (`kubectl get events -o wide`).
    pub fn action(self) -> &'static str {
        match self {
            EventReason::Allocated | EventReason::AllocationFailed | EventReason::StaleAllocation | EventReason::MetalLBAnnotation => "Allocate",
            EventReason::Released => "Release",
            EventReason::NotProgrammed => "Program",
            EventReason::OwnerChanged | EventReason::NotHeld | EventReason::Held | EventReason::ArpConflict | EventReason::ArpConflictResolved => "Announce",
            EventReason::Invalid => "Validate",
        }
    }

    /// When it is recorded.
    pub fn describe(self) -> &'static str {
        match self {
            EventReason::Allocated => "an address was written to its status (the note names it and its VipPool)",
            EventReason::Released => {
                "it gave an address back: it is no longer a LoadBalancer of vip's, the address is in no VipPool, or it no longer fits the Service or its pool"
            }
            EventReason::OwnerChanged => {
                "its VIP moved to another node (\"198.18.1.10 is now held by node b (was a)\", related to the new holder's Node); a first owner is no Event"
            }
            EventReason::AllocationFailed => "no address could be given; the note says why (retried on every change, recorded again when the reason changes)",
            EventReason::StaleAllocation => "it keeps an address its pool's selectors no longer admit (kept, not moved)",
            EventReason::MetalLBAnnotation => "it uses MetalLB's annotations: honoured, the note names vip's own to use instead (once per Service and note)",
            EventReason::NotProgrammed => "some of its service-ports did not fit the data path's tables (retried); recorded when that starts or changes",
            EventReason::NotHeld => {
                "its VIP is answered by no node; the note says why (every node able to hold its pool left out, or none alive); recorded when that starts or its reason changes"
            }
            EventReason::Held => "its VIP, reported `NotHeld`, is held by a node again",
            EventReason::ArpConflict => {
                "a peer's ARP self-check saw a MAC other than the holder's answer ARP for its VIP (once per episode; the note names the MACs)"
            }
            EventReason::ArpConflictResolved => "its VIP, reported `ArpConflict`, is answered by its holder alone again",
            EventReason::Invalid => "its spec is invalid or overlaps an older pool (the note names the field), with each write of its status while it is",
        }
    }

    /// The heading of docs/operations/troubleshooting.md that says what to do (its anchor).
    pub fn troubleshooting(self) -> Option<&'static str> {
        match self {
            EventReason::AllocationFailed => Some("allocationfailed"),
            EventReason::StaleAllocation => Some("staleallocation"),
            EventReason::MetalLBAnnotation => Some("metallbannotation"),
            EventReason::NotProgrammed => Some("notprogrammed"),
            EventReason::NotHeld => Some("notheld"),
            EventReason::ArpConflict => Some("arpconflict"),
            EventReason::Invalid => Some("vippool-conditions"),
            _ => None,
        }
    }

    /// The Event, with its note.
    pub fn event(self, note: String) -> Event {
        let type_ = if self.warning() { EventType::Warning } else { EventType::Normal };
        Event { type_, reason: self.name().into(), note: Some(note), action: self.action().into(), secondary: None }
    }
}

#[cfg(test)]
mod tests {
    use std::{
        collections::{BTreeMap, BTreeSet},
        net::IpAddr,
        time::{Duration, SystemTime},
    };

    use k8s_openapi::{
        apimachinery::pkg::apis::meta::v1::{Condition, Time},
        jiff::Timestamp,
    };

    use super::*;
    use crate::k8s::{pools, vipstatus};

    fn defined(object: Object) -> BTreeSet<(String, String, String)> {
        CONDITIONS
            .iter()
            .filter(|c| c.object == object)
            .flat_map(|c| c.states.iter().map(|s| (c.type_.to_owned(), s.status.to_owned(), s.reason.to_owned())))
            .collect()
    }

    fn written(cs: impl IntoIterator<Item = Condition>) -> BTreeSet<(String, String, String)> {
        cs.into_iter().map(|c| (c.type_, c.status, c.reason)).collect()
    }

    /// The pool conditions the controller writes, in each case: exactly those defined.
    #[test]
    fn the_pool_conditions_written_are_those_defined() {
        let now = Time(Timestamp::from_second(1_700_000_000).unwrap());
        let check = |problem: Option<&str>| pools::PoolCheck {
            name: "p".into(),
            valid: None,
            problem: problem.map(|r| (r.to_owned(), "spec.addresses: why".to_owned())),
        };
        let mut got = BTreeSet::new();
        for problem in [None, Some("InvalidSpec"), Some("Overlap")] {
            got.extend(written(pools::conditions(&check(problem), &[], &[], Some(1), &[], now.clone())));
        }
        let some = ["198.18.1.10 80/TCP: full".to_owned()];
        got.extend(written(pools::conditions(&check(None), &some, &some, Some(1), &[], now.clone())));
        // The same problems the pool checks give.
        let pool = |name: &str, yaml: &str| crate::k8s::crd::VipPool::new(name, serde_yaml_ng::from_str(yaml).unwrap());
        for c in pools::check_pools(&[pool("a", "addresses: [198.18.1.1]\n"), pool("b", "addresses: [198.18.1.1]\n"), pool("c", "addresses: [x]\n")]) {
            if let Some((reason, _)) = c.problem {
                assert!(got.contains(&(READY.to_owned(), "False".to_owned(), reason.clone())), "{reason}");
            }
        }
        let why = crate::model::NoHolder::NoneAlive { pool: "a".into(), eligible: vec!["n1".into()] };
        let unheld: BTreeMap<IpAddr, &crate::model::NoHolder> = [("198.18.1.10".parse().unwrap(), &why)].into();
        got.insert(written([crate::k8s::controller::held_condition(&BTreeMap::new(), Some(1), &[], &now)]).pop_first().unwrap());
        got.insert(written([crate::k8s::controller::held_condition(&unheld, Some(1), &[], &now)]).pop_first().unwrap());
        assert_eq!(got, defined(Object::VipPool));
        let mut types: Vec<String> = pools::conditions(&check(None), &[], &[], None, &[], now).into_iter().map(|c| c.type_).collect();
        types.push(HELD.to_owned());
        assert_eq!(types, condition_types(Object::VipPool), "written in the order defined");
    }

    /// The VipStatus conditions the holder and the controller write: exactly those defined.
    #[test]
    fn the_vipstatus_conditions_written_are_those_defined() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let check =
            |holder_answered: bool, foreign: Vec<[u8; 6]>| crate::ha::arpcheck::ArpCheck { by: "node-b".into(), at: t, holder_answered, foreign, since: t };
        let held = crate::ha::HeldVip {
            since: t,
            last_garp: None,
            interface: "eth1".into(),
            vlan: None,
            adopted: false,
            arp: Some(check(true, vec![[2, 0, 0, 0, 0, 9]])),
        };
        let mut got = written(vipstatus::held_state("node-a", &held, &[]).conditions);
        got.extend(written([vipstatus::arp_condition(&check(true, vec![])), vipstatus::arp_condition(&check(false, vec![]))]));
        got.extend(written(vipstatus::unheld_state("no eligible node alive", None).conditions));
        assert_eq!(got, defined(Object::VipStatus));
    }

    /// The CRDs' descriptions of `status.conditions` name every condition type written there.
    #[test]
    fn the_crds_describe_every_condition_type() {
        for (object, crd) in [(Object::VipPool, crate::k8s::crd::crd()), (Object::VipStatus, crate::k8s::crd::vip_status_crd())] {
            let v = serde_json::to_value(crd).unwrap();
            let d = v["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]["conditions"]["description"]
                .as_str()
                .unwrap_or_else(|| panic!("{}: no description of status.conditions", object.name()))
                .to_owned();
            let named: BTreeSet<&str> = d.split('`').skip(1).step_by(2).collect();
            for t in condition_types(object) {
                assert!(named.contains(t), "{}'s status.conditions description does not name `{t}`: {d}", object.name());
            }
            // And no type that is not written there.
            let others: BTreeSet<&str> = CONDITIONS.iter().filter(|c| c.object != object).map(|c| c.type_).collect();
            for t in others.iter().filter(|t| !condition_types(object).contains(t)) {
                assert!(!named.contains(t), "{}'s status.conditions description names `{t}`, not written there: {d}", object.name());
            }
        }
    }

    #[test]
    fn every_event_is_described_and_listed_once() {
        let names: BTreeSet<&str> = EventReason::ALL.iter().map(|e| e.name()).collect();
        assert_eq!(names.len(), EventReason::ALL.len());
        for e in EventReason::ALL {
            let ev = e.event("n".into());
            assert_eq!((ev.reason.as_str(), ev.action.as_str(), ev.note.as_deref()), (e.name(), e.action(), Some("n")));
            assert!(!e.describe().is_empty());
            assert_eq!(e.warning(), e.troubleshooting().is_some(), "{}: a Warning says what to do, a Normal Event needs nothing", e.name());
        }
    }
}
