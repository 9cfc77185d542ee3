//! The elected controller: while this agent leads, it keeps VipPool statuses
//! (conditions, counts) and Services' load-balancer addresses equal to what
//! `pools::check_pools` and `allocate::allocate` compute from the watched
//! objects, and records Events. The owners of the VIPs in use (as this node's
//! agent computes them) go into the pools' status, and an owner change is an Event
//! on each Service of the VIP. Every write carries the resourceVersion it was
//! computed from: a stale view gets a 409 and is recomputed, never applied.
//! It also keeps one VipStatus per VIP in use (created and deleted here; the
//! holder writes its status, this controller only `Held=False` while no node
//! holds the VIP, see `vipstatus`).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use k8s_openapi::{
    api::core::v1::{Namespace, Service},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    api::{Api, Patch, PatchParams},
    runtime::{
        events::{Event, Recorder, Reporter},
        reflector::Store,
    },
    Client, Resource, ResourceExt,
};
use prometheus_client::{encoding::EncodeLabelSet, metrics::gauge::Gauge};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{
    allocate::{self, Decision, PoolView},
    crd::{vip_status_name, VipPool, VipPoolStatus, VipStatus, VipStatusSpec},
    owned, pools, reflect,
    reports::{EventReason, ARP_CONFLICT, HELD},
    vipstatus,
};
use crate::model::NoHolder;

/// Labels of `vip_pool_addresses`, which the elected controller writes.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolStateLabels {
    pub pool: String,
    /// total, allocated or free.
    pub state: String,
}

/// What the node agent running this controller shares with it.
pub struct AgentView {
    /// VIP → owner node, as the agent computes it from its live view.
    pub owners: watch::Receiver<BTreeMap<IpAddr, String>>,
    /// `vip_pool_addresses`, set while leading.
    pub pool_addresses: Option<crate::metrics::Tracked<PoolStateLabels, Gauge>>,
    /// VIP → its service-ports the agent could not program ("port/proto: why").
    pub unprogrammed: watch::Receiver<BTreeMap<IpAddr, Vec<String>>>,
    /// VIP → why no node holds it (`agent::desired::unheld`).
    pub unheld: watch::Receiver<BTreeMap<IpAddr, NoHolder>>,
}

impl AgentView {
    /// A view whose owners the caller sets (tests, a controller without an agent).
    pub fn fixed(owners: BTreeMap<IpAddr, String>) -> (watch::Sender<BTreeMap<IpAddr, String>>, Self) {
        let (tx, rx) = watch::channel(owners);
        (tx, Self { owners: rx, pool_addresses: None, unprogrammed: watch::channel(BTreeMap::new()).1, unheld: watch::channel(BTreeMap::new()).1 })
    }
}

/// VIP → the Services using it (load-balancer ingress or external IP).
fn services_by_vip(services: &[Service]) -> BTreeMap<IpAddr, Vec<&Service>> {
    let mut m: BTreeMap<IpAddr, Vec<&Service>> = BTreeMap::new();
    for s in services {
        let external = s.spec.iter().flat_map(|sp| sp.external_ips.iter().flatten()).filter_map(|a| a.parse::<IpAddr>().ok());
        let vips: BTreeSet<IpAddr> = allocate::ingress_ips(s).into_iter().chain(external).collect();
        for v in vips {
            m.entry(v).or_default().push(s);
        }
    }
    m
}

/// What a pool's conditions say beyond its spec.
struct PoolProblems<'a> {
    /// Its service-ports the data path could not take ("VIP port/proto: why").
    unprogrammed: &'a [String],
    /// Services keeping an address its selectors no longer admit.
    stale: &'a [String],
    /// Its VIPs in use that no node holds, with why.
    unheld: BTreeMap<IpAddr, &'a NoHolder>,
}

/// What one pass did (for logs and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    pub allocated: usize,
    pub released: usize,
    pub pending: usize,
    /// Services that keep an address their pool's selectors no longer admit (newly reported).
    pub stale: usize,
    pub conflicts: usize,
    pub pool_statuses: usize,
    pub owner_events: usize,
    /// `MetalLBAnnotation` Warnings recorded (once per Service and note).
    pub metallb_warnings: usize,
    /// `NotHeld` Warnings and `Held` Events recorded.
    pub unheld_events: usize,
    /// VipStatuses created, deleted, and given a `Held=False` status.
    pub vip_statuses: usize,
    /// `ArpConflict` Warnings and `ArpConflictResolved` Events recorded.
    pub arp_events: usize,
}

pub struct Controller {
    client: Client,
    pools: Store<VipPool>,
    services: Store<Service>,
    namespaces: Store<Namespace>,
    vip_statuses: Store<VipStatus>,
    /// `Held=False` writes, at most one per VipStatus every few seconds.
    unheld_writes: vipstatus::Coalescer<String>,
    reporter: Reporter,
    /// Last Pending message per Service: an Event only when it changes.
    pending: BTreeMap<String, String>,
    view: AgentView,
    /// Owners already reported (Events); started from the pools' statuses, so a
    /// new leader does not repeat its predecessor's Events.
    reported: Option<BTreeMap<IpAddr, String>>,
    /// Unprogrammed service-ports already reported (Events), by VIP.
    reported_unprogrammed: BTreeMap<IpAddr, Vec<String>>,
    /// VIPs in use held by no node, already reported (Events), with why.
    reported_unheld: BTreeMap<IpAddr, NoHolder>,
    /// VIPs whose `ArpConflict` episode was reported (a Warning), by the time it
    /// started; started from the VipStatuses, so a new leader does not repeat it.
    reported_arp: Option<BTreeMap<IpAddr, Time>>,
    /// The addresses each of our Services held when last seen (with its uid): the
    /// server clears `status.loadBalancer` itself when a Service's type leaves
    /// LoadBalancer, so a release is only seen as a Service that held an address
    /// and no longer does. Started from this term's first view.
    held: BTreeMap<String, (String, BTreeSet<IpAddr>)>,
    /// Last stale-address message per Service: an Event only when it changes.
    stale: BTreeMap<String, String>,
    /// The MetalLB-annotation Warning last recorded per Service, with the uid it was
    /// for: once per Service and note (a changed annotation changes the note), not on
    /// every pass. Not per generation: a real API server keeps no
    /// `metadata.generation` on Services.
    metallb_said: BTreeMap<String, (String, String)>,
}

impl Controller {
    /// Starts the watches; `changed` fires on every watched change.
    pub fn new(client: Client, identity: &str, view: AgentView) -> (Self, mpsc::UnboundedReceiver<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pools = reflect(Api::<VipPool>::all(client.clone()), tx.clone());
        let services = reflect(Api::<Service>::all(client.clone()), tx.clone());
        let namespaces = reflect(Api::<Namespace>::all(client.clone()), tx.clone());
        let vip_statuses = reflect(Api::<VipStatus>::all(client.clone()), tx);
        let reporter = Reporter { controller: "vip-controller".into(), instance: Some(identity.into()) };
        (
            Self {
                client,
                pools,
                services,
                namespaces,
                vip_statuses,
                unheld_writes: vipstatus::Coalescer::new(vipstatus::MIN_INTERVAL),
                reporter,
                pending: BTreeMap::new(),
                view,
                reported: None,
                reported_unprogrammed: BTreeMap::new(),
                reported_unheld: BTreeMap::new(),
                reported_arp: None,
                held: BTreeMap::new(),
                stale: BTreeMap::new(),
                metallb_said: BTreeMap::new(),
            },
            rx,
        )
    }

    pub async fn wait_ready(&self) {
        let _ = self.pools.wait_until_ready().await;
        let _ = self.services.wait_until_ready().await;
        let _ = self.namespaces.wait_until_ready().await;
        let _ = self.vip_statuses.wait_until_ready().await;
    }

    /// One pass over the current view. Call only while leading.
    pub async fn pass(&mut self) -> Pass {
        let mut out = Pass::default();
        let pools: Vec<VipPool> = owned(self.pools.state());
        let services: Vec<Service> = owned(self.services.state());
        let ns_labels: BTreeMap<String, BTreeMap<String, String>> = self.namespaces.state().iter().map(|n| (n.name_any(), n.labels().clone())).collect();
        let checks = pools::check_pools(&pools);
        let views: Vec<PoolView> = checks
            .iter()
            .filter_map(|c| {
                let p = pools.iter().find(|p| p.name_any() == c.name)?;
                let v = c.valid.as_ref()?;
                Some(PoolView {
                    name: c.name.clone(),
                    addresses: v.addresses.clone(),
                    auto_assign: p.spec.auto_assign,
                    service_selector: p.spec.service_selector.clone(),
                    namespace_selector: p.spec.namespace_selector.clone(),
                })
            })
            .collect();
        out.released += self.notice_released(&services).await;
        out.metallb_warnings = self.report_metallb_annotations(&services).await;
        let decisions = allocate::allocate(&views, &services, &ns_labels);
        // Pool → its Services keeping an address the selectors no longer admit.
        let mut stale: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for d in &decisions {
            if let Decision::Stale { service, addr, pool, .. } = d {
                stale.entry(pool.clone()).or_default().push(format!("{service} {addr}"));
            }
        }
        self.stale.retain(|k, _| decisions.iter().any(|d| matches!(d, Decision::Stale { service, .. } if service == k)));
        let mut written = BTreeMap::new();
        for d in decisions {
            match self.apply(&d, &services, &mut written).await {
                Ok(true) => match d {
                    Decision::Allocate { .. } => out.allocated += 1,
                    Decision::Release { .. } => out.released += 1,
                    Decision::Pending { .. } => out.pending += 1,
                    Decision::Stale { .. } => out.stale += 1,
                },
                Ok(false) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => out.conflicts += 1,
                Err(e) => warn!("applying {d:?}: {e}"),
            }
        }
        // Counts from the watched statuses: they may lag this pass's own writes by a
        // moment; the watch event of those writes triggers the pass that settles them.
        let services_now: Vec<Service> = owned(self.services.state());
        let usage = allocate::pool_usage(&views, &services_now);
        let by_vip = services_by_vip(&services_now);
        let owners: BTreeMap<IpAddr, String> = self.view.owners.borrow().iter().filter(|(v, _)| by_vip.contains_key(v)).map(|(v, o)| (*v, o.clone())).collect();
        out.owner_events = self.report_owner_changes(&pools, &owners, &by_vip).await;
        let unprogrammed: BTreeMap<IpAddr, Vec<String>> =
            self.view.unprogrammed.borrow().iter().filter(|(v, _)| by_vip.contains_key(v)).map(|(v, e)| (*v, e.clone())).collect();
        self.report_unprogrammed(&unprogrammed, &by_vip).await;
        let unheld: BTreeMap<IpAddr, NoHolder> =
            self.view.unheld.borrow().iter().filter(|(v, _)| by_vip.contains_key(v)).map(|(v, w)| (*v, w.clone())).collect();
        out.unheld_events = self.report_unheld(&unheld, &owners, &by_vip).await;
        out.vip_statuses = self.sync_vip_statuses(&views, &by_vip, &unheld).await;
        out.arp_events = self.report_arp_conflicts(&by_vip).await;
        for (c, p) in checks.iter().filter_map(|c| Some((c, pools.iter().find(|p| p.name_any() == c.name)?))) {
            let in_pool: BTreeMap<String, String> = match &c.valid {
                Some(v) => owners.iter().filter(|(a, _)| v.addresses.contains(**a)).map(|(a, o)| (a.to_string(), o.clone())).collect(),
                None => BTreeMap::new(),
            };
            let bad: Vec<String> = match &c.valid {
                Some(v) => {
                    unprogrammed.iter().filter(|(a, _)| v.addresses.contains(**a)).flat_map(|(a, es)| es.iter().map(move |e| format!("{a} {e}"))).collect()
                }
                None => Vec::new(),
            };
            let stale = stale.get(&c.name).map_or(&[][..], Vec::as_slice);
            let not_held: BTreeMap<IpAddr, &NoHolder> = match &c.valid {
                Some(v) => unheld.iter().filter(|(a, _)| v.addresses.contains(**a)).map(|(a, w)| (*a, w)).collect(),
                None => BTreeMap::new(),
            };
            let said = PoolProblems { unprogrammed: &bad, stale, unheld: not_held };
            match self.write_pool_status(p, c, &said, usage.get(&c.name).copied(), in_pool).await {
                Ok(true) => out.pool_statuses += 1,
                Ok(false) => {}
                Err(kube::Error::Api(s)) if s.code == 409 => out.conflicts += 1,
                Err(e) => warn!(pool = %c.name, "status: {e}"),
            }
        }
        if let Some(g) = &self.view.pool_addresses {
            g.retain(|l| checks.iter().any(|c| c.name == l.pool));
        }
        out
    }

    /// Records an `OwnerChanged` Event on each Service of every VIP in use that
    /// moved from the owner last reported to another; returns how many were
    /// recorded. A first owner is no Event (the pool status shows it): a fresh
    /// install with a thousand Services records no thousand Events.
    async fn report_owner_changes(&mut self, pools: &[VipPool], owners: &BTreeMap<IpAddr, String>, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) -> usize {
        let reported = self.reported.get_or_insert_with(|| {
            pools.iter().flat_map(|p| p.status.iter().flat_map(|s| s.owners.iter())).filter_map(|(a, o)| Some((a.parse().ok()?, o.clone()))).collect()
        });
        let mut events = Vec::new();
        for (vip, owner) in owners {
            let Some(before) = reported.insert(*vip, owner.clone()) else { continue };
            if before == *owner {
                continue;
            }
            let note = format!("{vip} is now held by node {owner} (was {before})");
            for svc in by_vip.get(vip).into_iter().flatten() {
                // Related to the new owner's Node, for `kubectl describe node`.
                let node = k8s_openapi::api::core::v1::ObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Node".into()),
                    name: Some(owner.clone()),
                    ..Default::default()
                };
                events.push((Event { secondary: Some(node), ..EventReason::OwnerChanged.event(note.clone()) }, (*svc).clone()));
            }
        }
        reported.retain(|v, _| owners.contains_key(v));
        for (ev, svc) in &events {
            self.publish(ev, svc).await;
        }
        events.len()
    }

    /// One VipStatus per VIP of a valid pool in use: missing ones created, those of
    /// VIPs no longer in use deleted; `Held=False` written on those no node holds
    /// (those in `unheld`). Returns how many writes succeeded.
    async fn sync_vip_statuses(&mut self, pools: &[PoolView], by_vip: &BTreeMap<IpAddr, Vec<&Service>>, unheld: &BTreeMap<IpAddr, NoHolder>) -> usize {
        let in_use: BTreeMap<String, IpAddr> =
            by_vip.keys().filter(|v| pools.iter().any(|p| p.addresses.contains(**v))).map(|v| (vip_status_name(*v), *v)).collect();
        let seen: BTreeMap<String, Option<crate::k8s::crd::VipState>> = self.vip_statuses.state().iter().map(|o| (o.name_any(), o.status.clone())).collect();
        let api: Api<VipStatus> = Api::all(self.client.clone());
        let mut n = 0;
        for (name, vip) in in_use.iter().filter(|(name, _)| !seen.contains_key(*name)) {
            match api.create(&Default::default(), &VipStatus::new(name, VipStatusSpec { address: vip.to_string() })).await {
                Ok(_) => n += 1,
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                Err(e) => warn!(vipstatus = %name, "creating: {e}"),
            }
        }
        for name in seen.keys().filter(|name| !in_use.contains_key(*name)) {
            match api.delete(name, &Default::default()).await {
                Ok(_) => n += 1,
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => warn!(vipstatus = %name, "deleting: {e}"),
            }
        }
        let wants: BTreeMap<&String, crate::k8s::crd::VipState> = in_use
            .iter()
            .filter_map(|(name, vip)| {
                let seen = seen.get(name)?.as_ref();
                let why = unheld.get(vip)?;
                Some((name, vipstatus::unheld_state(&format!("{vip} is answered by no node: {why}"), seen)))
            })
            .collect();
        let differing: Vec<&String> = wants.iter().filter(|(name, w)| vipstatus::differs(seen[**name].as_ref(), w)).map(|(name, _)| *name).collect();
        let now = std::time::Instant::now();
        let (write, _) = self.unheld_writes.due(differing.into_iter().cloned(), now);
        for name in write {
            self.unheld_writes.wrote(name.clone(), now);
            match vipstatus::apply(&self.client, &name, "vip-controller", &wants[&name]).await {
                Ok(()) => n += 1,
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => warn!(vipstatus = %name, "status: {e}"),
            }
        }
        n
    }

    /// Records a `MetalLBAnnotation` Warning on each of our Services that uses
    /// MetalLB's annotations (they are honoured: the note suggests vip's own), once
    /// per Service and note (and once more in a new leader's term); returns how many
    /// were recorded.
    async fn report_metallb_annotations(&mut self, services: &[Service]) -> usize {
        let mut events = Vec::new();
        let mut said = BTreeMap::new();
        for s in services.iter().filter(|s| allocate::is_ours(s)) {
            let Some(note) = allocate::metallb_note(s) else { continue };
            let key = allocate::key(s);
            let now = (s.uid().unwrap_or_default(), note);
            if self.metallb_said.get(&key) != Some(&now) {
                events.push((now.1.clone(), s));
            }
            said.insert(key, now);
        }
        self.metallb_said = said;
        for (note, svc) in &events {
            let ev = EventReason::MetalLBAnnotation.event(note.clone());
            self.publish(&ev, *svc).await;
        }
        events.len()
    }

    /// Records a `NotProgrammed` Warning on each Service of a VIP whose
    /// service-ports the data path could not take, when that starts or changes.
    async fn report_unprogrammed(&mut self, now: &BTreeMap<IpAddr, Vec<String>>, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) {
        for (vip, errors) in now {
            if self.reported_unprogrammed.get(vip) == Some(errors) {
                continue;
            }
            // The agents retry every service-port that failed, of either family.
            let note = format!("{vip} is not in the data path, retried: {}", errors.join("; "));
            let ev = EventReason::NotProgrammed.event(note);
            for svc in by_vip.get(vip).into_iter().flatten() {
                self.publish(&ev, *svc).await;
            }
        }
        self.reported_unprogrammed = now.clone();
    }

    /// Records a `NotHeld` Warning on each Service of a VIP in use that no node
    /// holds (its address is not answered), when that starts or its reason
    /// changes, and a `Held` Event once a node holds it again; returns how many
    /// were recorded.
    async fn report_unheld(&mut self, now: &BTreeMap<IpAddr, NoHolder>, owners: &BTreeMap<IpAddr, String>, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) -> usize {
        let mut events = Vec::new();
        for (vip, why) in now {
            if self.reported_unheld.get(vip) != Some(why) {
                let note = format!("{vip} is answered by no node: {why}");
                events.push((*vip, EventReason::NotHeld.event(note)));
            }
        }
        for vip in self.reported_unheld.keys().filter(|v| !now.contains_key(v)) {
            let Some(owner) = owners.get(vip) else { continue };
            let note = format!("{vip} is held again, by node {owner}");
            events.push((*vip, EventReason::Held.event(note)));
        }
        // A VIP no longer in use, or with no owner yet in this view, is forgotten
        // only once it has one (no Held Event is lost to a lagging owner view).
        self.reported_unheld.retain(|v, _| by_vip.contains_key(v) && !owners.contains_key(v));
        self.reported_unheld.extend(now.iter().map(|(v, w)| (*v, w.clone())));
        let mut n = 0;
        for (vip, ev) in &events {
            for svc in by_vip.get(vip).into_iter().flatten() {
                self.publish(ev, *svc).await;
                n += 1;
            }
        }
        n
    }

    /// Records an `ArpConflict` Warning on each Service of a VIP whose VipStatus
    /// turned `ArpConflict=True` (its holder heard from a peer that another MAC
    /// answers ARP for it, `ha::arpcheck`), once per episode (by the condition's
    /// transition time), and an `ArpConflictResolved` Event when it turns False;
    /// returns how many were recorded.
    async fn report_arp_conflicts(&mut self, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) -> usize {
        let now: BTreeMap<IpAddr, k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> = self
            .vip_statuses
            .state()
            .iter()
            .filter_map(|o| Some((o.spec.address.parse().ok()?, o.status.as_ref()?.conditions.iter().find(|c| c.type_ == ARP_CONFLICT)?.clone())))
            .collect();
        let reported = self
            .reported_arp
            .get_or_insert_with(|| now.iter().filter(|(_, c)| c.status == "True").map(|(v, c)| (*v, c.last_transition_time.clone())).collect());
        let mut events = Vec::new();
        for (vip, c) in &now {
            if c.status == "True" && reported.get(vip) != Some(&c.last_transition_time) {
                reported.insert(*vip, c.last_transition_time.clone());
                let note = format!("{vip}: {}", c.message);
                events.push((*vip, EventReason::ArpConflict.event(note)));
            } else if c.status == "False" && reported.remove(vip).is_some() {
                let note = format!("{vip}: {}", c.message);
                events.push((*vip, EventReason::ArpConflictResolved.event(note)));
            }
        }
        reported.retain(|v, _| now.contains_key(v));
        let mut n = 0;
        for (vip, ev) in &events {
            for svc in by_vip.get(vip).into_iter().flatten() {
                self.publish(ev, *svc).await;
                n += 1;
            }
        }
        n
    }

    /// Records a `Released` Event for each address one of our Services held and no
    /// longer holds now that it is not ours: the server cleared its status when its
    /// type left LoadBalancer (kube-apiserver v1.36 behaviour, checked against the
    /// real server in tests), so there is nothing to write, only to say. An address
    /// still in the status is released by `allocate` (a status write, then the Event).
    async fn notice_released(&mut self, services: &[Service]) -> usize {
        let mut events = Vec::new();
        let mut held = BTreeMap::new();
        for s in services {
            let key = allocate::key(s);
            let uid = s.uid().unwrap_or_default();
            let now: BTreeSet<IpAddr> = allocate::ingress_ips(s).into_iter().collect();
            let before = self.held.remove(&key).filter(|(u, _)| *u == uid).map(|(_, a)| a).unwrap_or_default();
            if allocate::is_ours(s) {
                // Without an address in this view: keep what we last knew (the view
                // may not show our own write yet).
                held.insert(key, (uid, if now.is_empty() { before } else { now }));
                continue;
            }
            for a in before.difference(&now) {
                let note = format!("{a}: {}", allocate::why_not_ours(s));
                events.push((EventReason::Released.event(note), s));
            }
        }
        self.held = held;
        for (ev, svc) in &events {
            info!(service = %allocate::key(svc), note = ?ev.note, "released by the server");
            self.publish(ev, *svc).await;
        }
        events.len()
    }

    /// Applies one decision; Ok(false) when there was nothing to write. `written`:
    /// the Services whose status this pass wrote (true) or failed to (false): a
    /// Service's decisions carry the same final `ingress`, written once.
    async fn apply(&mut self, d: &Decision, services: &[Service], written: &mut BTreeMap<String, bool>) -> Result<bool, kube::Error> {
        let key = d.service().to_owned();
        let Some(svc) = services.iter().find(|s| allocate::key(s) == key) else { return Ok(false) };
        let (ns, name) = (svc.namespace().unwrap_or_else(|| "default".into()), svc.name_any());
        let api: Api<Service> = Api::namespaced(self.client.clone(), &ns);
        let rv = svc.resource_version();
        let (ingress, event) = match d {
            Decision::Allocate { addr, pool, ingress, .. } => (ingress, EventReason::Allocated.event(format!("{addr} from VipPool {pool}"))),
            Decision::Release { addr, why, ingress, .. } => (ingress, EventReason::Released.event(format!("{addr}: {why}"))),
            // Nothing to write: a Warning, once per message.
            Decision::Pending { why, .. } => return Ok(self.warn_once(|c| &mut c.pending, EventReason::AllocationFailed, &key, why.to_string(), svc).await),
            Decision::Stale { why, .. } => return Ok(self.warn_once(|c| &mut c.stale, EventReason::StaleAllocation, &key, why.clone(), svc).await),
        };
        match written.get(&key) {
            Some(false) => return Ok(false),
            Some(true) => {}
            None => {
                self.pending.remove(&key);
                let list: Vec<serde_json::Value> = ingress.iter().map(|a| json!({ "ip": a.to_string() })).collect();
                // The resourceVersion makes this a compare-and-swap: a Service changed
                // since we computed the decision (or another leader wrote it) gives a 409.
                let patch = json!({ "metadata": { "resourceVersion": rv }, "status": { "loadBalancer": { "ingress": list } } });
                let r = api.patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch)).await;
                written.insert(key.clone(), r.is_ok());
                r?;
                info!(service = %key, ?ingress, "service status written");
                self.held.insert(key.clone(), (svc.uid().unwrap_or_default(), ingress.iter().copied().collect()));
            }
        }
        self.publish(&event, svc).await;
        Ok(true)
    }

    /// A Warning on `svc` with `why`, unless `said` (this controller's last
    /// message per Service of that kind) already holds it; whether one was sent.
    async fn warn_once(&mut self, said: fn(&mut Self) -> &mut BTreeMap<String, String>, reason: EventReason, key: &str, why: String, svc: &Service) -> bool {
        let said = said(self);
        if said.get(key) == Some(&why) {
            return false;
        }
        said.insert(key.to_owned(), why.clone());
        self.publish(&reason.event(why), svc).await;
        true
    }

    /// Records `ev` about `obj` as a new Event. A fresh Recorder each time: a kept
    /// one folds every later Event of the same reason about the same object into
    /// the first one's series, keeping the first note (a changed MetalLB annotation
    /// or allocation failure would show the old message); each caller already says
    /// a thing only once.
    async fn publish<K: Resource<DynamicType = ()>>(&self, ev: &Event, obj: &K) {
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(e) = recorder.publish(ev, &obj.object_ref(&())).await {
            warn!("event: {e}");
        }
    }

    /// Writes a pool's status when it differs; Ok(false) when it was already right.
    async fn write_pool_status(
        &self,
        p: &VipPool,
        c: &pools::PoolCheck,
        said: &PoolProblems<'_>,
        usage: Option<(u32, u32)>,
        owners: BTreeMap<String, String>,
    ) -> Result<bool, kube::Error> {
        let old = p.status.clone().unwrap_or_default();
        let now = Time(Timestamp::now());
        let total = c.valid.as_ref().map_or(0, |v| v.addresses.len() as u32);
        let (allocated, free) = usage.unwrap_or((0, total));
        let mut conditions = pools::conditions(c, said.unprogrammed, said.stale, p.metadata.generation, &old.conditions, now.clone());
        conditions.push(held_condition(&said.unheld, p.metadata.generation, &old.conditions, &now));
        let new = VipPoolStatus { conditions, observed_generation: p.metadata.generation, total, allocated, free, owners };
        if let Some(g) = &self.view.pool_addresses {
            for (state, n) in [("total", new.total), ("allocated", new.allocated), ("free", new.free)] {
                g.with(&PoolStateLabels { pool: c.name.clone(), state: state.into() }, |g| g.set(n.into()));
            }
        }
        let same_conditions = old.conditions.len() == new.conditions.len()
            && old.conditions.iter().zip(&new.conditions).all(|(a, b)| {
                (&a.type_, &a.status, &a.reason, &a.message, a.observed_generation) == (&b.type_, &b.status, &b.reason, &b.message, b.observed_generation)
            });
        if same_conditions
            && (old.total, old.allocated, old.free, old.observed_generation, &old.owners)
                == (new.total, new.allocated, new.free, new.observed_generation, &new.owners)
        {
            return Ok(false);
        }
        let api: Api<VipPool> = Api::all(self.client.clone());
        // A merge patch keeps keys it does not name: owners that left are nulled.
        let mut status = serde_json::to_value(&new).unwrap_or_default();
        for gone in old.owners.keys().filter(|k| !new.owners.contains_key(*k)) {
            status["owners"][gone] = serde_json::Value::Null;
        }
        let patch = json!({ "metadata": { "resourceVersion": p.resource_version() }, "status": status });
        api.patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(&patch)).await?;
        if let Some((_, why)) = &c.problem {
            self.publish(&EventReason::Invalid.event(why.clone()), p).await;
        }
        Ok(true)
    }
}

/// The pool's `Held` condition: whether every VIP of it in use has a node that
/// answers it, and if not which VIPs and why (grouped by reason).
pub(crate) fn held_condition(
    unheld: &BTreeMap<IpAddr, &NoHolder>,
    generation: Option<i64>,
    previous: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    now: &Time,
) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition {
    if unheld.is_empty() {
        return pools::condition(HELD, "True", "AllHeld", "every VIP of the pool in use is held by a node".into(), generation, previous, now);
    }
    let mut by_why: BTreeMap<&NoHolder, Vec<String>> = BTreeMap::new();
    for (vip, why) in unheld {
        by_why.entry(*why).or_default().push(vip.to_string());
    }
    let groups: Vec<String> = by_why.into_iter().map(|(why, vips)| format!("{}: {why}", vips.join(", "))).collect();
    let msg = format!("{} VIP(s) in use held by no node, not answered: {}", unheld.len(), pools::some_of(&groups));
    pools::condition(HELD, "False", "NoHolder", msg, generation, previous, now)
}

/// Runs the controller: a pass after every watched change (coalesced) and every
/// `resync`, while `leader` is true.
pub async fn run(client: Client, identity: String, mut leader: watch::Receiver<bool>, resync: Duration, view: AgentView) {
    let mut owners = view.owners.clone();
    let mut owners_open = true;
    let mut unprogrammed = view.unprogrammed.clone();
    let mut unprogrammed_open = true;
    let mut unheld = view.unheld.clone();
    let mut unheld_open = true;
    let (mut c, mut changed) = Controller::new(client, &identity, view);
    c.wait_ready().await;
    loop {
        if *leader.borrow() {
            let p = c.pass().await;
            if p != Pass::default() {
                info!(?p, "controller pass");
            }
        } else {
            // A later term starts again from what the pools' statuses report, and
            // from the Services as they are then (another leader reported meanwhile).
            c.reported = None;
            c.reported_unheld.clear();
            c.reported_arp = None;
            c.held.clear();
            c.stale.clear();
            // Only the leader's counts are current.
            if let Some(g) = &c.view.pool_addresses {
                g.retain(|_| false);
            }
        }
        tokio::select! {
            Some(()) = changed.recv() => {
                // Coalesce a burst of changes into one pass.
                tokio::time::sleep(Duration::from_millis(20)).await;
                while changed.try_recv().is_ok() {}
            }
            r = leader.changed() => if r.is_err() { return },
            r = owners.changed(), if owners_open => owners_open = r.is_ok(),
            r = unprogrammed.changed(), if unprogrammed_open => unprogrammed_open = r.is_ok(),
            r = unheld.changed(), if unheld_open => unheld_open = r.is_ok(),
            _ = tokio::time::sleep(resync) => {}
        }
    }
}

#[cfg(test)]
mod tests;
