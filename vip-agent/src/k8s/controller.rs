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
//!
//! Here the pass and its loop; what it writes is split by where it goes:
//! `services` (Services' addresses), `statuses` (VipPool and VipStatus statuses),
//! `events` (Events).
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
    time::Duration,
};

use k8s_openapi::{
    api::core::v1::{Namespace, Service},
    apimachinery::pkg::apis::meta::v1::Time,
};
use kube::{
    api::Api,
    runtime::{events::Reporter, reflector::Store},
    Client, ResourceExt,
};
use prometheus_client::{encoding::EncodeLabelSet, metrics::gauge::Gauge};
use tokio::sync::{mpsc, watch};
use tracing::{info, warn};

use super::{
    allocate::{self, Decision, PoolView},
    crd::{VipPool, VipStatus},
    owned, pools, reflect, vipstatus,
};
use crate::model::NoHolder;

mod events;
mod services;
mod statuses;

// The tests of this module and of `reports` check the condition it writes.
#[cfg(test)]
pub(crate) use statuses::held_condition;
use statuses::PoolProblems;

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
