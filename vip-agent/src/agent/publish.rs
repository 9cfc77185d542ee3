//! Publishing what the agent does: the status (file and `/status`), the gauges,
//! and what the controller reads (owners, service-ports not programmed).
use std::{collections::BTreeMap, net::IpAddr};

use tracing::warn;

use super::{health_targets, liveness, Agent};
use crate::metrics;
use crate::{
    spec::Mac,
    status::{check_label, write_atomic, HealthStatus, NodeStatus, ServiceStatus, UnprogrammedStatus},
};

impl Agent {
    /// Refreshes the status (file and /status) and the gauges.
    pub(super) fn publish(&mut self) {
        let guard = {
            let uplinks = &self.liveness_tx.borrow().uplinks;
            crate::route_guard::Guard {
                // Home too: frames to VIPs of other networks reach backends there.
                ifaces: uplinks.by_pool.values().chain(&uplinks.home).flat_map(|l| [l.name.clone(), l.xdp_iface.clone()]).collect(),
                vips: self.applied.keys().chain(self.failed.keys()).map(|a| a.vip).collect(),
            }
        };
        self.guard_tx.send_if_modified(|cur| {
            let changed = *cur != guard;
            *cur = guard;
            changed
        });
        let usage = self.dp.usage();
        self.metrics.services_unprogrammed.set(self.failed.len() as i64);
        self.metrics.services_programmed.set(usage.services as i64);
        self.metrics.services_capacity.set(usage.services_max.into());
        self.metrics.ring_slots_used.set(usage.ring_slots as i64);
        self.metrics.ring_slots_capacity.set(usage.ring_capacity as i64);
        self.metrics.rings.set(usage.rings as i64);
        let s = &mut self.status;
        s.usage = usage;
        s.owners = self.membership.owners.clone();
        s.bgp = self.speaker.status().borrow().clone();
        s.held = self.membership.held.iter().copied().collect();
        let checks: BTreeMap<&str, String> = self.world.services.iter().filter_map(|v| Some((v.name.as_str(), check_label(v.health.as_ref()?)))).collect();
        s.services = self
            .applied
            .iter()
            .map(|(a, d)| ServiceStatus {
                name: d.name.clone(),
                vip: a.vip,
                port: a.port,
                protocol: a.protocol.name().to_owned(),
                backends: d.spec.backends.iter().map(|b| b.name.clone()).collect(),
                draining: d.spec.draining.iter().map(|b| b.name.clone()).collect(),
                check: checks.get(d.name.as_str()).cloned(),
                failing_open: d.failing_open,
            })
            .collect();
        let mut backends: BTreeMap<IpAddr, std::collections::BTreeSet<String>> = BTreeMap::new();
        for (a, d) in &self.applied {
            backends.entry(a.vip).or_default().extend(d.spec.backends.iter().map(|b| b.name.clone()));
        }
        let backends: BTreeMap<IpAddr, Vec<String>> = backends.into_iter().map(|(v, b)| (v, b.into_iter().collect())).collect();
        self.backends_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &backends));
        let mut by_vip: BTreeMap<IpAddr, Vec<String>> = BTreeMap::new();
        for (a, (_, e)) in &self.failed {
            by_vip.entry(a.vip).or_default().push(format!("{}/{}: {e}", a.port, a.protocol));
        }
        self.unprogrammed_tx.send_if_modified(|cur| liveness::replace_if_changed(cur, &by_vip));
        s.unprogrammed = self
            .failed
            .iter()
            .map(|(a, (name, e))| UnprogrammedStatus {
                name: name.clone(),
                vip: a.vip,
                port: a.port,
                protocol: a.protocol.name().to_owned(),
                error: e.to_string(),
            })
            .collect();
        s.nodes = self
            .world
            .nodes
            .iter()
            .map(|n| NodeStatus {
                node: n.name.clone(),
                addr: n.addr,
                mac: n.mac.or_else(|| self.macs.get(&n.name).copied()).map(|m| Mac(m).to_string()),
                version: if n.name == self.me {
                    Some(crate::model::VERSION.to_owned())
                } else {
                    self.peer_settings.get(&n.name).and_then(|s| crate::model::version_of(s)).map(str::to_owned)
                },
            })
            .collect();
        s.health.clear();
        let mut healthy_now = Vec::new();
        for t in health_targets(&self.world) {
            let (healthy, detail) = match self.health.get(&t) {
                Some((up, d)) => (*up, d.clone()),
                None => (true, "no state change yet".into()),
            };
            let check = check_label(&t.check);
            healthy_now.push((metrics::BackendLabels { node: t.node.clone(), check: check.clone() }, healthy as i64));
            s.health.push(HealthStatus { node: t.node, check, healthy, detail });
        }
        self.metrics.backend_healthy.set_all(healthy_now);
        self.metrics.set_names(metrics::Names {
            services: self.applied.iter().map(|(a, d)| (*a, d.name.clone())).collect(),
            nodes: self.world.nodes.iter().map(|n| (crate::dataplane::backend_key(n.addr), n.name.clone())).collect(),
        });
        self.status.updated_unix_ms = crate::status::unix_ms_now();
        let json = serde_json::to_string(&self.status).unwrap_or_default();
        if let Some(path) = &self.status_file {
            if let Err(e) = write_atomic(path, &json) {
                warn!("writing status file {}: {e:#}", path.display());
            }
        }
        *self.status_json.lock().unwrap_or_else(|e| e.into_inner()) = json;
    }
}
