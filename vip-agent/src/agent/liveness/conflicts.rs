//! Other MACs claiming VIPs: the conflicts the data path counts, and the ARP
//! self-check's turns and findings.
use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use anyhow::Result;
use tracing::warn;

use super::{selfcheck, Liveness};
use crate::ha::arpcheck;

impl Liveness {
    /// `arp_conflicts` counts on every interface VIPs are held under.
    pub(super) fn conflicts_now(&self) -> BTreeMap<IpAddr, u64> {
        self.uplinks.held_ifindices().into_iter().flat_map(|i| self.s.held.conflicts(i).unwrap_or_default()).collect()
    }

    /// One turn of the ARP self-check as a checker ([`selfcheck::SelfCheck::turn`]).
    pub(super) fn arp_check(&mut self) {
        let mut cx = selfcheck::Ctx { held: &mut self.s.held, metrics: &self.s.metrics, frames: &self.arp_tx, world: &self.world, uplinks: &self.uplinks };
        if self.arp.turn(&mut cx) {
            self.tell_held();
        }
    }

    /// A checker's findings for VIPs this node holds ([`selfcheck::SelfCheck::findings`]).
    pub(super) fn arp_findings(&mut self, from: &str, findings: Vec<arpcheck::Finding>) {
        let mut cx = selfcheck::Ctx { held: &mut self.s.held, metrics: &self.s.metrics, frames: &self.arp_tx, world: &self.world, uplinks: &self.uplinks };
        if self.arp.findings(from, findings, &self.held, &self.since, &mut cx) {
            self.tell_held();
        }
    }

    /// Conflicting claims the data path counted: `arp_conflict` and `ndp_conflict`.
    pub(super) fn conflict_count(&self) -> Result<u64> {
        let arp = self.s.held.reason_count(vip_common::Reason::ArpConflict)?.0;
        Ok(arp + self.s.held.reason_count(vip_common::Reason::NdpConflict)?.0)
    }

    /// Logs and counts ARP replies, gratuitous ARP or Neighbor Advertisements from
    /// another MAC claiming a VIP we hold (counted by the data path as
    /// `arp_conflict`, `ndp_conflict`).
    pub(super) fn watch_conflicts(&mut self) {
        let Ok(n) = self.conflict_count() else { return };
        if n > self.conflicts {
            self.s.metrics.arp_conflicts.inc_by(n - self.conflicts);
            // Which VIPs: those whose count in arp_conflicts went up (a new entry
            // counts from 0). Whoever claimed them (a partitioned node, a node that
            // woke up) may have pulled clients away; the holder's announcement of
            // those VIPs, and only those, brings them back.
            let now = self.conflicts_now();
            let contested: BTreeSet<IpAddr> =
                now.iter().filter(|(v, c)| **c > self.contested.get(v).copied().unwrap_or(0) && self.held.contains_key(v)).map(|(v, _)| *v).collect();
            warn!(new = n - self.conflicts, vips = ?contested, "ARP conflict: another MAC claims a VIP this node holds; re-announcing it");
            self.contested = now;
            self.announce(contested, false);
        }
        self.conflicts = n;
    }
}
