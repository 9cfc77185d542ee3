//! The statuses the controller keeps: each VipPool's (conditions, counts, owners)
//! and one VipStatus per VIP in use.
use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::{api::core::v1::Service, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    api::{Api, Patch, PatchParams},
    ResourceExt,
};
use serde_json::json;
use tracing::warn;

use super::{Controller, PoolStateLabels};
use crate::{
    k8s::{
        allocate::PoolView,
        crd::{vip_status_name, VipPool, VipPoolStatus, VipStatus, VipStatusSpec},
        pools,
        reports::{EventReason, HELD},
        vipstatus,
    },
    model::NoHolder,
};

/// What a pool's conditions say beyond its spec.
pub(super) struct PoolProblems<'a> {
    /// Its service-ports the data path could not take ("VIP port/proto: why").
    pub(super) unprogrammed: &'a [String],
    /// Services keeping an address its selectors no longer admit.
    pub(super) stale: &'a [String],
    /// Its VIPs in use that no node holds, with why.
    pub(super) unheld: BTreeMap<IpAddr, &'a NoHolder>,
}

impl Controller {
    /// One VipStatus per VIP of a valid pool in use: missing ones created, those of
    /// VIPs no longer in use deleted; `Held=False` written on those no node holds
    /// (those in `unheld`). Returns how many writes succeeded.
    pub(super) async fn sync_vip_statuses(
        &mut self,
        pools: &[PoolView],
        by_vip: &BTreeMap<IpAddr, Vec<&Service>>,
        unheld: &BTreeMap<IpAddr, NoHolder>,
    ) -> usize {
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

    /// Writes a pool's status when it differs; Ok(false) when it was already right.
    pub(super) async fn write_pool_status(
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
