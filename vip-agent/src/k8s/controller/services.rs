//! The Services' side: their load-balancer addresses written as `allocate`
//! decides, and releases the server made itself.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use k8s_openapi::api::core::v1::Service;
use kube::{
    api::{Api, Patch, PatchParams},
    ResourceExt,
};
use serde_json::json;
use tracing::info;

use super::Controller;
use crate::k8s::{
    allocate::{self, Decision},
    reports::EventReason,
};

impl Controller {
    /// Records a `Released` Event for each address one of our Services held and no
    /// longer holds now that it is not ours: the server cleared its status when its
    /// type left LoadBalancer (kube-apiserver v1.36 behaviour, checked against the
    /// real server in tests), so there is nothing to write, only to say. An address
    /// still in the status is released by `allocate` (a status write, then the Event).
    pub(super) async fn notice_released(&mut self, services: &[Service]) -> usize {
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
    pub(super) async fn apply(&mut self, d: &Decision, services: &[Service], written: &mut BTreeMap<String, bool>) -> Result<bool, kube::Error> {
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
    pub(super) async fn warn_once(
        &mut self,
        said: fn(&mut Self) -> &mut BTreeMap<String, String>,
        reason: EventReason,
        key: &str,
        why: String,
        svc: &Service,
    ) -> bool {
        let said = said(self);
        if said.get(key) == Some(&why) {
            return false;
        }
        said.insert(key.to_owned(), why.clone());
        self.publish(&reason.event(why), svc).await;
        true
    }
}
