//! `VipStatus` statuses: the holder of each VIP writes its own (holder, interface,
//! VLAN, since, last gratuitous ARP, backends, `Held=True`); the elected
//! controller writes `Held=False` for a VIP in use that no node holds. Both by
//! server-side apply with force, naming every field (null when unknown): whoever
//! writes last replaces all of the previous writer's fields, so after a failover
//! the status names the new holder. Each writer compares what it wants with what it
//! sees (a reflector of VipStatuses) and writes a VIP at most every
//! [`MIN_INTERVAL`]: a burst of changes is one write, and a writer that sees its
//! write undone by a stale one (a previous holder's in flight) writes again.
//!
//! The holder's writer runs on the agent's main runtime, fed by `watch`es: the
//! liveness thread only sends on one, so a failover never waits for the API server.
use std::{
    collections::BTreeMap,
    net::IpAddr,
    time::{Duration, Instant},
};

use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use kube::{
    api::{Api, Patch, PatchParams},
    runtime::reflector::Store,
    Client, ResourceExt,
};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info};

use super::{
    api_health,
    crd::{vip_status_name, VipState, VipStatus},
    reflect,
    reports::{ARP_CONFLICT, HELD},
};
use crate::ha::HeldVip;

/// The shortest time between two writes of one VIP's status by one writer.
pub const MIN_INTERVAL: Duration = Duration::from_secs(3);

/// Which keys to write now, with a write per key at most every `every`: a key
/// that changed again within that time waits for the rest of it, and is then
/// written once with whatever it wants by then.
#[derive(Debug)]
pub struct Coalescer<K> {
    every: Duration,
    last: BTreeMap<K, Instant>,
}

impl<K: Ord + Clone> Coalescer<K> {
    pub fn new(every: Duration) -> Self {
        Self { every, last: BTreeMap::new() }
    }

    /// Of the keys whose status differs from what is wanted, those to write at
    /// `now`, and when the first of the others is due (None: no other).
    /// Keys no longer differing are forgotten once their interval is over.
    pub fn due(&mut self, differing: impl IntoIterator<Item = K>, now: Instant) -> (Vec<K>, Option<Instant>) {
        let every = self.every;
        self.last.retain(|_, t| now.duration_since(*t) < every);
        let mut write = Vec::new();
        let mut next: Option<Instant> = None;
        for k in differing {
            match self.last.get(&k) {
                Some(t) => {
                    let at = *t + every;
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
                None => write.push(k),
            }
        }
        (write, next)
    }

    /// `key` was written (or tried) at `now`.
    pub fn wrote(&mut self, key: K, now: Instant) {
        self.last.insert(key, now);
    }
}

fn time(t: std::time::SystemTime) -> Option<Time> {
    Timestamp::try_from(t).ok().map(Time)
}

/// The `ArpConflict` condition of a VIP a peer checked (see `ha::arpcheck`):
/// True when a MAC other than the holder's answered the peer's ARP request,
/// False when only the holder's did, Unknown when none did.
pub fn arp_condition(c: &crate::ha::arpcheck::ArpCheck) -> Condition {
    let (status, reason, message) = if !c.foreign.is_empty() {
        let holder = if c.holder_answered { "besides the holder" } else { "and the holder did not answer" };
        (
            "True",
            "ForeignAnswer",
            format!(
                "node {} asked who answers ARP for the VIP: {} answered, {holder}; a second responder on the segment (another load balancer, a host with the address) or a switch or proxy answering from a stale cache: clients may be sent there",
                c.by,
                c.foreign_text()
            ),
        )
    } else if c.holder_answered {
        ("False", "HolderOnly", format!("only the holder answers ARP for the VIP (asked from node {})", c.by))
    } else {
        ("Unknown", "NoAnswer", format!("node {} saw no answer to its ARP request for the VIP", c.by))
    };
    Condition {
        type_: ARP_CONFLICT.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        observed_generation: None,
        last_transition_time: time(c.since).unwrap_or_else(|| Time(Timestamp::now())),
    }
}

/// What `node`'s VipStatus of `vip` says while `node` holds it.
pub fn held_state(node: &str, vip: &HeldVip, backends: &[String]) -> VipState {
    let since = time(vip.since);
    let vlan = vip.vlan.map(|v| format!(" VLAN {v}")).unwrap_or_default();
    let held = Condition {
        type_: HELD.into(),
        status: "True".into(),
        reason: "Held".into(),
        message: format!("held by node {node} on {}{vlan}", vip.interface),
        observed_generation: None,
        last_transition_time: since.clone().unwrap_or_else(|| Time(Timestamp::now())),
    };
    VipState {
        holder: Some(node.to_owned()),
        interface: Some(vip.interface.clone()),
        vlan: vip.vlan,
        held_since: since,
        last_gratuitous_arp: vip.last_garp.and_then(time),
        backends: backends.to_vec(),
        conditions: std::iter::once(held).chain(vip.arp.as_ref().map(arp_condition)).collect(),
    }
}

/// The take-over time of a VIP this agent found held at its start (`adopted`):
/// the `heldSince` its VipStatus shows when it names this node as the holder
/// (the agent before this one, with no gap between them), else this agent's
/// own; `None` for a VIP this agent took itself.
fn adopted_since(node: &str, vip: &HeldVip, seen: Option<&VipState>) -> Option<std::time::SystemTime> {
    if !vip.adopted {
        return None;
    }
    let earlier = seen.filter(|s| s.holder.as_deref() == Some(node)).and_then(|s| s.held_since.as_ref()).map(|t| std::time::SystemTime::from(t.0));
    Some(earlier.filter(|t| *t < vip.since).unwrap_or(vip.since))
}

/// What the VipStatus of a VIP no node holds says: no holder, `Held=False`
/// (`NoHolder`, `why`), transitioned when it last became False (kept from `seen`).
pub fn unheld_state(why: &str, seen: Option<&VipState>) -> VipState {
    let was = seen.and_then(|s| s.conditions.iter().find(|c| c.type_ == HELD && c.status == "False"));
    let held = Condition {
        type_: HELD.into(),
        status: "False".into(),
        reason: "NoHolder".into(),
        message: why.into(),
        observed_generation: None,
        last_transition_time: was.map_or_else(|| Time(Timestamp::now()), |c| c.last_transition_time.clone()),
    };
    VipState { conditions: vec![held], ..VipState::default() }
}

/// `want` as the server will store it (times to the second): what to compare with what is seen.
fn stored(want: &VipState) -> VipState {
    serde_json::to_value(want).ok().and_then(|v| serde_json::from_value(v).ok()).unwrap_or_default()
}

/// Whether the status seen differs from `want`.
pub fn differs(seen: Option<&VipState>, want: &VipState) -> bool {
    seen.cloned().unwrap_or_default() != stored(want)
}

/// Writes `state` as the whole status of VipStatus `name`, as `manager`.
pub async fn apply(client: &Client, name: &str, manager: &str, state: &VipState) -> Result<(), kube::Error> {
    let api: Api<VipStatus> = Api::all(client.clone());
    let body = json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipStatus", "metadata": { "name": name }, "status": state });
    api.patch_status(name, &PatchParams::apply(manager).force(), &Patch::Apply(&body)).await.map(|_| ())
}

/// The status of each VipStatus seen, by name.
fn seen(store: &Store<VipStatus>) -> BTreeMap<String, Option<VipState>> {
    store.state().iter().map(|o| (o.name_any(), o.status.clone())).collect()
}

/// A field manager name the server takes (at most 128 characters).
fn manager(node: &str) -> String {
    node.chars().take(128).collect()
}

/// The holder's writer: keeps the status of every VIP `node` holds (`held`, from
/// the liveness thread; `backends`, the ring's nodes by VIP) equal to what it
/// wants, at most one write per VIP every [`MIN_INTERVAL`]. A VIP whose VipStatus
/// does not exist yet (the controller creates it) is written once it does.
pub async fn run_holder(
    client: Client,
    node: String,
    mut held: watch::Receiver<BTreeMap<IpAddr, HeldVip>>,
    mut backends: watch::Receiver<BTreeMap<IpAddr, Vec<String>>>,
) {
    let (tx, mut changed) = mpsc::unbounded_channel();
    let store = reflect(Api::<VipStatus>::all(client.clone()), tx);
    let _ = store.wait_until_ready().await;
    let who = manager(&node);
    let mut limit = Coalescer::new(MIN_INTERVAL);
    let what = "write vipstatuses";
    // The take-over times of adopted VIPs, decided at their first look (by the
    // `since` the liveness thread gave them, which changes if one is taken anew).
    let mut kept: BTreeMap<IpAddr, (std::time::SystemTime, std::time::SystemTime)> = BTreeMap::new();
    loop {
        let seen = seen(&store);
        let wants: BTreeMap<String, VipState> = {
            let held = held.borrow_and_update();
            let backends = backends.borrow_and_update();
            kept.retain(|v, (since, _)| held.get(v).is_some_and(|h| h.adopted && h.since == *since));
            held.iter()
                .map(|(v, h)| {
                    let name = vip_status_name(*v);
                    let mut h = h.clone();
                    if let Some(s) = adopted_since(&node, &h, seen.get(&name).and_then(Option::as_ref)) {
                        h.since = kept.entry(*v).or_insert((h.since, s)).1;
                    }
                    (name, held_state(&node, &h, backends.get(v).map_or(&[][..], Vec::as_slice)))
                })
                .collect()
        };
        let differing = wants.iter().filter(|(n, w)| seen.get(*n).is_some_and(|s| differs(s.as_ref(), w))).map(|(n, _)| n.clone());
        let now = Instant::now();
        let (write, next) = limit.due(differing.collect::<Vec<_>>(), now);
        for name in write {
            limit.wrote(name.clone(), now);
            match apply(&client, &name, &who, &wants[&name]).await {
                Ok(()) => {
                    api_health().ok(what);
                    debug!(vipstatus = %name, "status written");
                }
                // Deleted meanwhile (the VIP left its Services): nothing to write.
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => api_health().failed(what, &e),
            }
        }
        let wake = async {
            match next {
                Some(at) => tokio::time::sleep_until(at.into()).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = held.changed() => if r.is_err() {
                info!("the liveness thread stopped: VipStatus writer stopping");
                return;
            },
            r = backends.changed() => if r.is_err() { return },
            Some(()) = changed.recv() => {
                // A burst of watch events is one look.
                tokio::time::sleep(Duration::from_millis(20)).await;
                while changed.try_recv().is_ok() {}
            }
            _ = wake => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use super::*;

    #[test]
    fn coalescer_writes_a_key_at_most_once_per_interval() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let mut c = Coalescer::new(3 * s);
        // First change: written at once.
        assert_eq!(c.due(["a"], t0), (vec!["a"], None));
        c.wrote("a", t0);
        // Changes within the interval wait for its end; another key is not held up.
        assert_eq!(c.due(["a", "b"], t0 + s), (vec!["b"], Some(t0 + 3 * s)));
        c.wrote("b", t0 + s);
        assert_eq!(c.due(["a", "b"], t0 + 2 * s), (vec![], Some(t0 + 3 * s)));
        // At its end, one write with whatever is wanted then.
        assert_eq!(c.due(["a", "b"], t0 + 3 * s), (vec!["a"], Some(t0 + 4 * s)));
        c.wrote("a", t0 + 3 * s);
        // Nothing differing: nothing to do, nothing to wake for.
        assert_eq!(c.due(Vec::<&str>::new(), t0 + 3 * s), (vec![], None));
        // A quiet key is written at once on its next change.
        assert_eq!(c.due(["b"], t0 + 10 * s), (vec!["b"], None));
    }

    fn held(vlan: Option<u16>, garp: bool) -> HeldVip {
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        HeldVip { since, last_garp: garp.then(|| since + Duration::from_millis(1500)), interface: "eth1".into(), vlan, adopted: false, arp: None }
    }

    #[test]
    fn held_state_names_every_field() {
        let s = held_state("node-a", &held(Some(30), true), &["node-a".into(), "node-b".into()]);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(v["holder"], "node-a");
        assert_eq!((v["interface"].as_str(), v["vlan"].as_u64()), (Some("eth1"), Some(30)));
        assert_eq!(v["heldSince"], "2023-11-14T22:13:20Z");
        assert_eq!(v["backends"], json!(["node-a", "node-b"]));
        let c = &v["conditions"][0];
        assert_eq!(
            (c["type"].as_str(), c["status"].as_str(), c["message"].as_str()),
            (Some("Held"), Some("True"), Some("held by node node-a on eth1 VLAN 30"))
        );
        assert_eq!(c["lastTransitionTime"], v["heldSince"]);
        // Untagged, announced on the loopback: null, not absent (the apply names them).
        let v = serde_json::to_value(held_state("node-a", &held(None, false), &[])).unwrap();
        assert!(v["vlan"].is_null() && v["lastGratuitousArp"].is_null() && v.get("vlan").is_some() && v.get("lastGratuitousArp").is_some(), "{v}");
    }

    /// Sub-second differences the server does not keep are no difference (no
    /// write each time the clock moves); a new holder, a new GARP second are.
    #[test]
    fn differs_compares_what_the_server_keeps() {
        let want = held_state("node-a", &held(None, true), &["node-a".into()]);
        let seen = stored(&want);
        assert_eq!(seen.last_gratuitous_arp.as_ref().map(|t| t.0.subsec_nanosecond()), Some(0));
        assert!(!differs(Some(&seen), &want));
        assert!(differs(None, &want));
        assert!(differs(Some(&stored(&held_state("node-b", &held(None, true), &["node-a".into()]))), &want));
        let mut later = held(None, true);
        later.last_garp = later.last_garp.map(|t| t + Duration::from_secs(30));
        assert!(differs(Some(&seen), &held_state("node-a", &later, &["node-a".into()])));
        // An unheld status keeps the time it became unheld.
        let first = stored(&unheld_state("no eligible node alive", None));
        let again = unheld_state("no eligible node alive", Some(&first));
        assert!(!differs(Some(&first), &again));
        assert!(again.holder.is_none() && again.backends.is_empty());
    }

    /// A restarted agent that found the VIP held keeps the take-over time the
    /// status shows when it names this node; not another node's, not a later one,
    /// and not for a VIP it took itself.
    #[test]
    fn an_adopted_vip_keeps_its_take_over_time() {
        let mut h = held(None, true);
        let earlier = h.since - Duration::from_secs(3600);
        let seen = |holder: &str| VipState { holder: Some(holder.into()), held_since: time(earlier), ..VipState::default() };
        assert_eq!(adopted_since("node-a", &h, Some(&seen("node-a"))), None, "taken by this agent: its own time");
        h.adopted = true;
        assert_eq!(adopted_since("node-a", &h, Some(&seen("node-a"))), Some(earlier));
        assert_eq!(adopted_since("node-a", &h, Some(&seen("node-b"))), Some(h.since), "another node's time is not ours");
        assert_eq!(adopted_since("node-a", &h, None), Some(h.since));
        let later = VipState { holder: Some("node-a".into()), held_since: time(h.since + Duration::from_secs(5)), ..VipState::default() };
        assert_eq!(adopted_since("node-a", &h, Some(&later)), Some(h.since));
    }

    /// The ArpConflict condition follows the last check: True with the foreign
    /// MACs and the checker, False when only the holder answered, Unknown when
    /// nobody did; absent before any check.
    #[test]
    fn the_arp_check_is_a_condition() {
        use crate::ha::arpcheck::ArpCheck;
        let since = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_100);
        let check = |foreign: Vec<[u8; 6]>, holder_answered| ArpCheck { by: "node-b".into(), at: since, holder_answered, foreign, since };
        let cond = |c: Option<ArpCheck>| {
            let v = serde_json::to_value(held_state("node-a", &HeldVip { arp: c, ..held(None, true) }, &[])).unwrap();
            v["conditions"].as_array().unwrap().iter().find(|c| c["type"] == "ArpConflict").cloned()
        };
        assert_eq!(cond(None), None);
        let c = cond(Some(check(vec![[2, 0, 0, 0, 0, 0xbb]], true))).unwrap();
        assert_eq!(
            (c["status"].as_str(), c["reason"].as_str(), c["lastTransitionTime"].as_str()),
            (Some("True"), Some("ForeignAnswer"), Some("2023-11-14T22:15:00Z"))
        );
        let m = c["message"].as_str().unwrap();
        assert!(m.contains("02:00:00:00:00:bb") && m.contains("node node-b") && m.contains("besides the holder"), "{m}");
        assert_eq!(cond(Some(check(vec![], true))).unwrap()["status"], "False");
        assert_eq!(cond(Some(check(vec![], false))).unwrap()["reason"], "NoAnswer");
    }
}
