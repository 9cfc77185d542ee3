//! Leader election with a `coordination.k8s.io/v1` Lease: one agent allocates
//! addresses and writes statuses. The loop is small and does what client-go's
//! leader election does: read the Lease, take it when it is free or expired (as
//! observed on our own monotonic clock, so clock skew between nodes does not
//! matter), renew it while we hold it, and always write with the resourceVersion
//! we read, so of two racing candidates exactly one wins (409 for the other).
//! (No crate built on kube 5 does this safely: kube-lease-manager releases an
//! expired Lease with an unconditional patch, which can wipe a fresher lock; see
//! docs/development/dependencies.md.)
//!
//! Leadership is a `watch::Receiver<bool>`. It turns false as soon as a renewal
//! fails past the point where another candidate could have taken over, before the
//! lease has expired for the others.
use std::time::{Duration, Instant};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    api::{Api, PostParams},
    Client,
};
use tokio::sync::watch;
use tracing::info;

#[derive(Clone, Debug)]
pub struct LeaderConfig {
    pub namespace: String,
    pub name: String,
    /// This agent (the node name).
    pub identity: String,
    /// How long a holder that stopped renewing keeps the lease.
    pub lease_duration: Duration,
    /// How often the holder renews (and candidates look).
    pub retry_period: Duration,
}

impl LeaderConfig {
    pub fn new(namespace: &str, identity: &str) -> Self {
        Self {
            namespace: namespace.into(),
            name: "vip-controller".into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// What we last saw of the Lease, and when (our clock).
#[derive(Default)]
struct LeaseSeen {
    record: Option<(Option<String>, Option<MicroTime>)>,
    at: Option<Instant>,
}

/// Starts the election loop; the receiver says whether this agent leads now.
pub fn spawn(client: Client, cfg: LeaderConfig) -> watch::Receiver<bool> {
    let (tx, rx) = watch::channel(false);
    tokio::spawn(async move {
        let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
        let mut seen = LeaseSeen::default();
        // Until this instant our hold is certain (last successful write + duration − a margin).
        let mut sure_until: Option<Instant> = None;
        let what = format!("lease {}", cfg.name);
        // After an outage the next round comes within `retry_period` (2 s) of the
        // server being back: the holder renews then (and leads again if it had
        // stopped); a candidate, whose requests failed too, starts its clock on the
        // Lease afresh, so it does not take a Lease the holder is about to renew.
        loop {
            let attempt = Instant::now();
            match try_lead(&api, &cfg, &mut seen).await {
                Ok(held) => {
                    super::api_health().ok(&what);
                    sure_until = held.then(|| attempt + cfg.lease_duration.saturating_sub(cfg.retry_period));
                }
                Err(e) => {
                    // Logged (rate-limited) and counted with the watches' errors.
                    super::api_health().failed(&what, &e);
                    // What we saw before the failure is forgotten: the holder's renewals
                    // we could not see must not count as its silence.
                    seen.record = None;
                }
            }
            let leading = sure_until.is_some_and(|t| Instant::now() < t);
            if tx.send_if_modified(|cur| std::mem::replace(cur, leading) != leading) {
                info!(lease = %cfg.name, identity = %cfg.identity, leading, "leadership changed");
            }
            if tx.is_closed() {
                break;
            }
            tokio::time::sleep(cfg.retry_period).await;
        }
    });
    rx
}

fn now_micro() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// One round: Ok(true) when we hold the lease after it.
async fn try_lead(api: &Api<Lease>, cfg: &LeaderConfig, seen: &mut LeaseSeen) -> Result<bool, kube::Error> {
    let mine = Some(cfg.identity.clone());
    let current = match api.get_opt(&cfg.name).await? {
        Some(l) => l,
        None => {
            let lease = Lease {
                metadata: ObjectMeta { name: Some(cfg.name.clone()), namespace: Some(cfg.namespace.clone()), ..Default::default() },
                spec: Some(LeaseSpec {
                    holder_identity: mine,
                    lease_duration_seconds: Some(cfg.lease_duration.as_secs() as i32),
                    acquire_time: Some(now_micro()),
                    renew_time: Some(now_micro()),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return conflict_is_false(api.create(&PostParams::default(), &lease).await.map(|_| true));
        }
    };
    let spec = current.spec.clone().unwrap_or_default();
    let record = (spec.holder_identity.clone(), spec.renew_time.clone());
    if seen.record.as_ref() != Some(&record) {
        seen.record = Some(record);
        seen.at = Some(Instant::now());
    }
    let held_by_us = spec.holder_identity == mine;
    let duration = Duration::from_secs(spec.lease_duration_seconds.unwrap_or(15).max(1) as u64);
    let expired = spec.holder_identity.is_none() || seen.at.is_some_and(|t| t.elapsed() > duration);
    if !held_by_us && !expired {
        return Ok(false);
    }
    let mut next = current.clone();
    let s = next.spec.get_or_insert_with(Default::default);
    if !held_by_us {
        s.holder_identity = mine;
        s.acquire_time = Some(now_micro());
        s.lease_transitions = Some(s.lease_transitions.unwrap_or(0) + 1);
    }
    s.renew_time = Some(now_micro());
    s.lease_duration_seconds = Some(cfg.lease_duration.as_secs() as i32);
    // `next` carries the resourceVersion we read: a concurrent writer makes this a 409.
    conflict_is_false(api.replace(&cfg.name, &PostParams::default(), &next).await.map(|_| true))
}

fn conflict_is_false(r: Result<bool, kube::Error>) -> Result<bool, kube::Error> {
    match r {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(false),
        other => other,
    }
}
