//! The Events the controller records on Services: owners that changed, MetalLB
//! annotations, service-ports not programmed, VIPs no node holds, ARP conflicts.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::core::v1::Service;
use kube::{
    runtime::events::{Event, Recorder},
    Resource, ResourceExt,
};
use tracing::warn;

use super::Controller;
use crate::{
    k8s::{
        allocate,
        crd::VipPool,
        reports::{EventReason, ARP_CONFLICT},
    },
    model::NoHolder,
};

impl Controller {
    /// Records an `OwnerChanged` Event on each Service of every VIP in use that
    /// moved from the owner last reported to another; returns how many were
    /// recorded. A first owner is no Event (the pool status shows it): a fresh
    /// install with a thousand Services records no thousand Events.
    pub(super) async fn report_owner_changes(
        &mut self,
        pools: &[VipPool],
        owners: &BTreeMap<IpAddr, String>,
        by_vip: &BTreeMap<IpAddr, Vec<&Service>>,
    ) -> usize {
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

    /// Records a `MetalLBAnnotation` Warning on each of our Services that uses
    /// MetalLB's annotations (they are honoured: the note suggests vip's own), once
    /// per Service and note (and once more in a new leader's term); returns how many
    /// were recorded.
    pub(super) async fn report_metallb_annotations(&mut self, services: &[Service]) -> usize {
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
    pub(super) async fn report_unprogrammed(&mut self, now: &BTreeMap<IpAddr, Vec<String>>, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) {
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
    pub(super) async fn report_unheld(
        &mut self,
        now: &BTreeMap<IpAddr, NoHolder>,
        owners: &BTreeMap<IpAddr, String>,
        by_vip: &BTreeMap<IpAddr, Vec<&Service>>,
    ) -> usize {
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
    pub(super) async fn report_arp_conflicts(&mut self, by_vip: &BTreeMap<IpAddr, Vec<&Service>>) -> usize {
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

    /// Records `ev` about `obj` as a new Event. A fresh Recorder each time: a kept
    /// one folds every later Event of the same reason about the same object into
    /// the first one's series, keeping the first note (a changed MetalLB annotation
    /// or allocation failure would show the old message); each caller already says
    /// a thing only once.
    pub(super) async fn publish<K: Resource<DynamicType = ()>>(&self, ev: &Event, obj: &K) {
        let recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        if let Err(e) = recorder.publish(ev, &obj.object_ref(&())).await {
            warn!("event: {e}");
        }
    }
}
