//! Applying a model to the service maps: what they should hold (`desired`), the
//! difference written as one batch (each service on its own), then the flows
//! swept. The liveness thread never waits for any of it.
use std::{collections::BTreeMap, time::Instant};

use tracing::{error, info, warn};

use super::{desired, Agent, DesiredService, Observed};
use crate::metrics;
use crate::{
    dataplane::{self, ServiceAddr},
    health::Target,
    neighbour,
};

impl Agent {
    /// Computes what the service maps should hold and writes the difference
    /// (outside the async scheduler: map writes are system calls). `since`: the
    /// health change that caused this, for the latency metric.
    pub(super) fn reconcile(&mut self, since: Option<Instant>) {
        tokio::task::block_in_place(|| self.reconcile_now(since));
    }

    pub(super) fn reconcile_now(&mut self, since: Option<Instant>) {
        // One read of the neighbour table for every node whose MAC the model lacks.
        let unknown: Vec<&crate::model::Node> = self.world.nodes.iter().filter(|n| n.mac.is_none() && n.name != self.me).collect();
        let table = if unknown.is_empty() { neighbour::Table::new() } else { neighbour::table() };
        for n in unknown {
            match table.get(&n.addr) {
                Some(m) => {
                    self.macs.insert(n.name.clone(), *m);
                }
                None if !self.macs.contains_key(&n.name) => neighbour::solicit(n.addr),
                None => {}
            }
        }
        self.macs_tx.send_if_modified(|cur| super::liveness::replace_if_changed(cur, &self.macs));
        let health: BTreeMap<Target, bool> = self.health.iter().map(|(t, (up, _))| (t.clone(), *up)).collect();
        let m = &self.membership;
        let want = desired(
            &self.world,
            &Observed {
                me: &self.me,
                tracked: &m.tracked,
                live: &m.live,
                leaving: &m.leaving,
                serving: &self.serving,
                health: &health,
                joining: &self.joining,
                macs: &self.macs,
            },
        );
        self.unresolved = want.unresolved;
        for (a, d) in &want.services {
            let was = self.applied.get(a).is_some_and(|o| o.failing_open);
            if d.failing_open && !was {
                warn!(service = %d.name, vip = %a.vip, port = a.port, backends = d.spec.backends.len(), "every backend's health check is down: failing open, new connections go to all of them");
            } else if was && !d.failing_open {
                info!(service = %d.name, vip = %a.vip, port = a.port, "no longer failing open");
            }
        }
        // Per node rather than per service-port (thousands share a check).
        let drained = |m: &mut dyn Iterator<Item = &DesiredService>| -> std::collections::BTreeSet<String> {
            m.flat_map(|d| d.spec.draining.iter().map(|b| b.name.clone())).collect()
        };
        let (was, now) = (drained(&mut self.applied.values()), drained(&mut want.services.values()));
        for n in now.difference(&was) {
            info!(node = %n, "backend draining: its health check failed while its node runs; out of the rings for new flows, its established flows stay");
        }
        for n in was.difference(&now) {
            info!(node = %n, "backend no longer draining");
        }
        self.metrics
            .service_failing_open
            .set_all(want.services.iter().filter(|(_, d)| d.failing_open).map(|(a, d)| (metrics::ServiceLabels::new(&d.name, a), 1)));
        // What changed, and what the maps hold that the model no longer has
        // (from the data path's own record, so services left by an earlier agent
        // are swept too).
        let set: BTreeMap<ServiceAddr, &dataplane::ServiceSpec> =
            super::desired::changed(&self.applied, &want.services).into_iter().map(|(a, d)| (a, &*d.spec)).collect();
        let remove: Vec<ServiceAddr> = self.dp.service_addrs().into_iter().filter(|a| !want.services.contains_key(a)).collect();
        self.applied.retain(|a, _| want.services.contains_key(a));
        self.failed.retain(|a, _| want.services.contains_key(a));
        let mut sweep = dataplane::Sweep::default();
        if !set.is_empty() || !remove.is_empty() {
            match self.dp.apply(&set, &remove, self.world.maglev_seed) {
                Ok(mut done) => {
                    sweep = std::mem::take(&mut done.sweep);
                    self.record(&want.services, &set, done);
                }
                Err(e) => error!("programming services: {e:#}"),
            }
        }
        // Every affected ring is written: that is when traffic follows the change.
        if let Some(at) = since {
            let took = at.elapsed();
            self.metrics.health_to_maps_seconds.observe(took.as_secs_f64());
            let l = &mut self.status.health_to_maps_us;
            l.push(took.as_micros() as u64);
            if l.len() > 256 {
                l.remove(0);
            }
            info!(took_us = took.as_micros() as u64, "health change written to the maps");
        }
        // Then flows pinned to backends their service lost re-hash.
        if !sweep.is_empty() {
            let t = Instant::now();
            match self.dp.sweep(&sweep) {
                Ok(n) => {
                    self.metrics.flow_sweep_seconds.observe(t.elapsed().as_secs_f64());
                    self.metrics.flows_evicted.inc_by(n as u64);
                    info!(evicted = n, us = t.elapsed().as_micros() as u64, "flow table swept");
                }
                Err(e) => error!("sweeping the flow table: {e:#}"),
            }
        }
        self.publish();
    }

    /// Takes note of what one batch did: applied services, failures (logged when
    /// they start or change, not on every retry), metrics.
    pub(super) fn record(
        &mut self,
        want: &BTreeMap<ServiceAddr, DesiredService>,
        set: &BTreeMap<ServiceAddr, &dataplane::ServiceSpec>,
        done: dataplane::Applied,
    ) {
        for addr in set.keys() {
            let d = &want[addr];
            match done.failed.get(addr) {
                Some(e) => {
                    if self.failed.get(addr).map(|(_, old)| old) != Some(e) {
                        error!(service = %d.name, vip = %addr.vip, port = addr.port, error = %e, capacity = e.is_capacity(), "service not programmed; it is retried, every other service goes on");
                    }
                    self.failed.insert(*addr, (d.name.clone(), e.clone()));
                }
                None => {
                    if self.failed.remove(addr).is_some() {
                        info!(service = %d.name, vip = %addr.vip, port = addr.port, "service programmed after all");
                    }
                    self.applied.insert(*addr, d.clone());
                }
            }
        }
        for (addr, slots) in &done.written {
            let l = metrics::ServiceLabels::new(&want[addr].name, addr);
            self.metrics.ring_updates.with(&l, |c| c.inc());
            self.metrics.ring_slots_written.with(&l, |c| c.inc_by(*slots as u64));
        }
        // The series of service-ports gone (or renamed) go with them.
        let keep: std::collections::HashSet<metrics::ServiceLabels> = want.iter().map(|(a, d)| metrics::ServiceLabels::new(&d.name, a)).collect();
        self.metrics.ring_updates.retain(|l| keep.contains(l));
        self.metrics.ring_slots_written.retain(|l| keep.contains(l));
        for addr in &done.removed {
            info!(vip = %addr.vip, port = addr.port, "service removed");
        }
        self.metrics.map_write_seconds.observe(done.write_time.as_secs_f64());
        info!(changed = set.len(), removed = done.removed.len(), failed = done.failed.len(), write_us = done.write_time.as_micros() as u64, "services written");
    }
}
