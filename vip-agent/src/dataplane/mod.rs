//! The one userspace facade over the XDP data path: load and attach, hold and
//! release VIPs, set a service's backends (Maglev ring writes), read counters.
//!
//! All state lives in maps pinned under one bpffs directory, so a restarted agent
//! re-opens them (and the still-attached program) without interrupting traffic.
mod attach;
mod flow_cache;
mod ring_alloc;
mod xmit;

use std::{
    collections::{BTreeMap, BTreeSet},
    net::Ipv4Addr,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::{
    maps::{Array, HashMap, Map, MapData, PerCpuArray},
    programs::{TestRun, TestRunOptions, Xdp},
    Ebpf,
};
pub use attach::{detach, iface_info, AttachMode};
pub use xmit::XdpXmit;
use vip_common::{map_names as names, *};

use crate::maglev::{self, Member};

/// The XDP object built by `cargo xtask build-ebpf`, embedded at build time.
pub static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/vip.bpf.o"));

pub const DEFAULT_PIN_DIR: &str = "/sys/fs/bpf/vip";

/// A backend node as the data path needs it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSpec {
    /// Stable identity (node name): the Maglev permutation is derived from it.
    pub name: String,
    pub addr: Ipv4Addr,
    pub mac: [u8; 6],
    pub weight: u32,
    /// This node itself: matching packets are passed to the local stack.
    pub local: bool,
}

/// (VIP, port, protocol) of a service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ServiceAddr {
    pub vip: Ipv4Addr,
    pub port: u16,
    pub proto: u8,
}

impl ServiceAddr {
    pub fn key(&self) -> ServiceKey {
        ServiceKey {
            vip: self.vip.octets(),
            port: self.port.to_be_bytes(),
            proto: self.proto,
            _pad: 0,
        }
    }
    fn from_key(k: &ServiceKey) -> Self {
        Self { vip: Ipv4Addr::from(k.vip), port: u16::from_be_bytes(k.port), proto: k.proto }
    }
}

/// What one `set_service` call wrote.
#[derive(Clone, Debug, Default)]
pub struct RingUpdate {
    pub slots_written: usize,
    pub table_size: u32,
    pub elapsed: Duration,
}

/// Summed counters.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Counters {
    pub reasons: BTreeMap<&'static str, (u64, u64)>,
    pub services: BTreeMap<u32, (u64, u64)>,
    pub backends: BTreeMap<u32, (u64, u64)>,
}

pub struct Dataplane {
    dir: PathBuf,
    /// Present when this process loaded the object (attach, tests, bench).
    ebpf: Option<Ebpf>,
    ifaces: HashMap<MapData, u32, IfaceConfig>,
    held: HashMap<MapData, HeldKey, HeldVip>,
    services: HashMap<MapData, ServiceKey, Service>,
    backends: Array<MapData, Backend>,
    ring: Array<MapData, u32>,
    flows: HashMap<MapData, FlowKey, Flow>,
    stats: PerCpuArray<MapData, Counter>,
    service_stats: PerCpuArray<MapData, Counter>,
    backend_stats: PerCpuArray<MapData, Counter>,
    /// Bumped after every change a cached answer may depend on (see flow_cache).
    epoch: flow_cache::Ctl,
    ring_alloc: ring_alloc::RingAlloc,
    /// Last ring written per service (a cache of lb4_ring; rebuilt from it on open).
    rings: BTreeMap<ServiceAddr, Vec<u32>>,
    /// The slots of lb4_backends in use (a cache of the array; rebuilt from it on
    /// open), so that finding an id does not read all MAX_BACKENDS slots.
    backend_slots: BTreeMap<u32, Backend>,
}

/// How much earlier than asked a held VIP goes stale in `arp_held`: two ticks of
/// CLOCK_MONOTONIC_COARSE. The data path reads the coarse clock
/// (`bpf_ktime_get_coarse_ns`, about 3 ns against 25 ns for `bpf_ktime_get_ns` on
/// these machines), which lags CLOCK_MONOTONIC by up to a tick; storing the
/// deadline two ticks early keeps the fencing promise: never answered past it.
pub fn coarse_slack_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC_COARSE exists on Linux.
    let res = if unsafe { libc::clock_getres(libc::CLOCK_MONOTONIC_COARSE, &mut ts) } == 0 {
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    } else {
        10_000_000 // HZ=100, the coarsest tick
    };
    2 * res
}

/// CLOCK_MONOTONIC now, the clock deadlines are given in (the data path compares
/// them with its coarse variant, see [`coarse_slack_ns`]).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn take<T: TryFrom<Map, Error = aya::maps::MapError>>(ebpf: &mut Ebpf, name: &str) -> Result<T> {
    let map = ebpf.take_map(name).ok_or_else(|| anyhow!("map {name} missing from the object"))?;
    T::try_from(map).with_context(|| format!("map {name} has an unexpected type"))
}

fn open_pinned<T: TryFrom<Map, Error = aya::maps::MapError>>(dir: &Path, name: &str) -> Result<T> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).with_context(|| {
        format!("opening pinned map {} (is the program loaded? run `vip-agent attach`)", path.display())
    })?;
    let map = Map::from_map_data(data)?;
    T::try_from(map).with_context(|| format!("pinned map {} has an unexpected type", path.display()))
}

macro_rules! maps_from {
    ($src:expr, $get:ident) => {{
        let s = $src;
        (
            $get(s, names::IFACES)?,
            $get(s, names::HELD)?,
            $get(s, names::SERVICES)?,
            $get(s, names::BACKENDS)?,
            $get(s, names::RING)?,
            $get(s, names::FLOWS)?,
            $get(s, names::STATS)?,
            $get(s, names::SERVICE_STATS)?,
            $get(s, names::BACKEND_STATS)?,
        )
    }};
}

impl Dataplane {
    /// Loads the embedded object with its maps pinned under `dir` (re-using maps
    /// already pinned there) and its program loaded into the kernel, not attached.
    /// `ring_capacity` is only used when the ring map does not exist yet.
    pub fn load(dir: &Path, ring_capacity: u32) -> Result<Self> {
        ensure_bpffs_dir(dir)?;
        let mut ebpf = aya::EbpfLoader::new()
            .default_map_pin_directory(dir)
            .map_max_entries(names::RING, ring_capacity)
            .load(OBJECT)
            .context("loading the XDP object (needs root or CAP_BPF)")?;
        let prog: &mut Xdp = ebpf
            .program_mut(PROGRAM_NAME)
            .ok_or_else(|| anyhow!("program {PROGRAM_NAME} missing from the object"))?
            .try_into()?;
        prog.load().context("the kernel verifier rejected the XDP program")?;
        xmit::load_and_pin(&mut ebpf, dir)?;
        let m = maps_from!(&mut ebpf, take);
        let mut epoch = flow_cache::Ctl(take(&mut ebpf, names::FLOW_CACHE_CTL)?);
        epoch.configure()?;
        Self::from_maps(dir, Some(ebpf), m, epoch)
    }

    /// Opens the maps pinned under `dir` by a running or earlier agent.
    pub fn open(dir: &Path) -> Result<Self> {
        let m = maps_from!(dir, open_pinned);
        let epoch = flow_cache::Ctl(open_pinned(dir, names::FLOW_CACHE_CTL)?);
        Self::from_maps(dir, None, m, epoch)
    }

    #[allow(clippy::type_complexity)]
    fn from_maps(
        dir: &Path,
        ebpf: Option<Ebpf>,
        m: (
            HashMap<MapData, u32, IfaceConfig>,
            HashMap<MapData, HeldKey, HeldVip>,
            HashMap<MapData, ServiceKey, Service>,
            Array<MapData, Backend>,
            Array<MapData, u32>,
            HashMap<MapData, FlowKey, Flow>,
            PerCpuArray<MapData, Counter>,
            PerCpuArray<MapData, Counter>,
            PerCpuArray<MapData, Counter>,
        ),
        epoch: flow_cache::Ctl,
    ) -> Result<Self> {
        let (ifaces, held, services, backends, ring, flows, stats, service_stats, backend_stats) = m;
        let mut dp = Self {
            dir: dir.to_owned(),
            ebpf,
            ring_alloc: ring_alloc::RingAlloc::new(ring.len()),
            ifaces,
            held,
            services,
            backends,
            ring,
            flows,
            stats,
            service_stats,
            backend_stats,
            epoch,
            rings: BTreeMap::new(),
            backend_slots: BTreeMap::new(),
        };
        dp.recover()?;
        Ok(dp)
    }

    /// Rebuilds the userspace caches (ring regions, rings) from the maps, so that
    /// a restarted agent diffs against what packets see now.
    fn recover(&mut self) -> Result<()> {
        for (id, b) in self.backends.iter().enumerate() {
            let b = b?;
            if b.flags & BACKEND_PRESENT != 0 {
                self.backend_slots.insert(id as u32, b);
            }
        }
        for (key, svc) in self.service_entries()? {
            if key.port == [0, 0] || svc.ring_size == 0 {
                continue; // fragment alias: shares its service's ring
            }
            self.ring_alloc.reserve(svc.ring_offset, svc.ring_size)?;
            let slots = (0..svc.ring_size)
                .map(|i| self.ring.get(&(svc.ring_offset + i), 0))
                .collect::<Result<Vec<_>, _>>()?;
            self.rings.insert(ServiceAddr::from_key(&key), slots);
        }
        Ok(())
    }

    pub fn pin_dir(&self) -> &Path {
        &self.dir
    }

    /// Runs the program once (or `repeat` times) on `frame` with BPF_PROG_TEST_RUN.
    /// Returns the verdict, the output frame and the mean duration per run.
    /// `live_batch`: run in live-frames mode (frames really go out), batch size.
    pub fn test_run(&mut self, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        self.test_run_program(PROGRAM_NAME, frame, repeat, live_batch)
    }

    /// [`Self::test_run`] for any XDP program of the object (loaded on first use),
    /// e.g. the benchmark's `xdp_baseline_pass`.
    pub fn test_run_program(&mut self, name: &str, frame: &[u8], repeat: u32, live_batch: Option<u32>) -> Result<(u32, Vec<u8>, Duration)> {
        let mut out = vec![0u8; frame.len() + 256];
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.repeat = repeat.max(1);
        if let Some(batch) = live_batch {
            opts.attrs = aya::programs::TestRunAttrs::new().xdp_live_frames(batch);
        } else {
            opts.data_out = Some(&mut out);
        }
        let ebpf = self.ebpf.as_mut().ok_or_else(|| anyhow!("program not loaded by this process"))?;
        let prog: &mut Xdp = ebpf.program_mut(name).ok_or_else(|| anyhow!("no program {name} in the object"))?.try_into()?;
        if prog.fd().is_err() {
            prog.load()?;
        }
        let r = prog.test_run(opts)?;
        out.truncate(r.data_size_out as usize);
        Ok((r.return_value, out, r.duration))
    }

    /// Records the MAC of an interface the program runs on (attach does this).
    /// VIPs already held on it get the new MAC too.
    pub fn set_iface(&mut self, ifindex: u32, mac: [u8; 6]) -> Result<()> {
        self.write_iface(ifindex, mac, None)
    }

    /// [`Self::set_iface`], with the interface's flags set to `flags`, or kept as
    /// recorded when `None`.
    fn write_iface(&mut self, ifindex: u32, mac: [u8; 6], flags: Option<u8>) -> Result<()> {
        let flags = flags.unwrap_or_else(|| self.ifaces.get(&ifindex, 0).map_or(0, |c| c.flags));
        self.ifaces.insert(ifindex, IfaceConfig { mac, flags, _pad: 0 }, 0)?;
        let stale: Vec<(HeldKey, HeldVip)> =
            self.held.iter().filter_map(|kv| kv.ok()).filter(|(k, h)| k.ifindex == ifindex && h.mac != mac).collect();
        let changed = !stale.is_empty();
        for (k, h) in stale {
            self.held.insert(k, HeldVip { mac, ..h }, 0)?;
        }
        if changed {
            self.epoch.bump()?; // cached answers carry the old MAC
        }
        Ok(())
    }

    /// Whether the program runs on `ifindex` in native mode, as recorded when this
    /// or an earlier agent attached it (the driver can then transmit XDP frames).
    pub fn iface_native(&self, ifindex: u32) -> bool {
        self.ifaces.get(&ifindex, 0).is_ok_and(|c| c.flags & IFACE_NATIVE != 0)
    }

    pub fn remove_iface(&mut self, ifindex: u32) -> Result<()> {
        ignore_missing(self.ifaces.remove(&ifindex))
    }

    /// Holds `vip` on `ifindex` until `deadline_ns` (CLOCK_MONOTONIC). Call again
    /// before it passes to keep holding; past it the data path stops answering
    /// (the entry stores `deadline_ns - coarse_slack_ns()`, see [`coarse_slack_ns`]).
    /// The entry carries the interface's MAC, so [`Self::set_iface`] (or
    /// [`Self::attach`]) must have recorded it first. No flow-cache epoch bump (this
    /// runs on every refresh): cached answers are only for pinned flows, which are
    /// forwarded whatever the deadline, and the MAC only changes through set_iface.
    pub fn hold_vip(&mut self, ifindex: u32, vip: Ipv4Addr, deadline_ns: u64) -> Result<()> {
        self.hold_vip_flags(ifindex, vip, deadline_ns, 0)
    }

    /// [`Self::hold_vip`] with `arp_held` flags (`HELD_NO_ARP`: balance, answer no ARP).
    pub fn hold_vip_flags(&mut self, ifindex: u32, vip: Ipv4Addr, deadline_ns: u64, flags: u8) -> Result<()> {
        let mac = match self.ifaces.get(&ifindex, 0) {
            Ok(cfg) => cfg.mac,
            Err(aya::maps::MapError::KeyNotFound) => bail!(
                "cannot hold {vip} on interface {ifindex}: no MAC recorded for it (attach to the interface, or call set_iface, first)"
            ),
            Err(e) => return Err(e).context("reading lb_ifaces"),
        };
        let key = HeldKey { ifindex, vip: vip.octets() };
        let deadline_ns = deadline_ns.saturating_sub(coarse_slack_ns());
        self.held.insert(key, HeldVip { deadline_ns, mac, flags, _pad: 0 }, 0)?;
        Ok(())
    }

    /// Stops holding `vip`: no more ARP answers and no new flows, but the entry
    /// stays (stale, deadline 0) so the flows this node already pinned keep being
    /// forwarded while clients still send to our MAC (until the new owner's
    /// gratuitous ARP reaches them). `forget_vip` removes it altogether.
    pub fn release_vip(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<()> {
        let key = HeldKey { ifindex, vip: vip.octets() };
        match self.held.get(&key, 0) {
            Ok(h) => {
                self.held.insert(key, HeldVip { deadline_ns: 0, ..h }, 0)?;
                // Cached answers are for pinned flows, which a stale entry still
                // forwards; bumped anyway so that every answer after a release is
                // taken from lb4_flows.
                self.epoch.bump()
            }
            Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).context("reading arp_held"),
        }
    }

    /// Removes `vip`'s entry (the VIP left every pool).
    pub fn forget_vip(&mut self, ifindex: u32, vip: Ipv4Addr) -> Result<()> {
        ignore_missing(self.held.remove(&HeldKey { ifindex, vip: vip.octets() }))?;
        self.epoch.bump() // its cached flows must stop being forwarded
    }

    /// Held VIPs as (ifindex, vip, deadline_ns), the deadline as stored: the one
    /// the data path applies, [`coarse_slack_ns`] before the one asked for.
    pub fn held_vips(&self) -> Result<Vec<(u32, Ipv4Addr, u64)>> {
        let mut v = Vec::new();
        for kv in self.held.iter() {
            let (k, h) = kv?;
            v.push((k.ifindex, Ipv4Addr::from(k.vip), h.deadline_ns));
        }
        v.sort();
        Ok(v)
    }

    /// The `arp_held` flags of `vip` on `ifindex` (0 when it is not held).
    pub fn held_flags(&self, ifindex: u32, vip: Ipv4Addr) -> u8 {
        self.held.get(&HeldKey { ifindex, vip: vip.octets() }, 0).map_or(0, |h| h.flags)
    }

    fn service_entries(&self) -> Result<Vec<(ServiceKey, Service)>> {
        Ok(self.services.iter().collect::<Result<Vec<_>, _>>()?)
    }

    /// Services as (address, entry, ring) for inspection.
    pub fn services(&self) -> Result<Vec<(ServiceAddr, Service, Vec<u32>)>> {
        let mut v = Vec::new();
        for (k, s) in self.service_entries()? {
            let addr = ServiceAddr::from_key(&k);
            let ring = self.rings.get(&addr).cloned().unwrap_or_default();
            v.push((addr, s, ring));
        }
        v.sort_by_key(|(a, _, _)| *a);
        Ok(v)
    }

    /// Backends in use (slots of `lb4_backends` with `BACKEND_PRESENT`), by id.
    pub fn backends(&self) -> Result<BTreeMap<u32, Backend>> {
        Ok(self.backend_slots.clone())
    }

    /// Backend id for `spec`, re-using the id of a backend with the same address,
    /// else the lowest free slot of `lb4_backends`.
    fn backend_id(&mut self, spec: &BackendSpec) -> Result<u32> {
        let want = Backend {
            mac: spec.mac,
            _pad: [0; 2],
            addr: spec.addr.octets(),
            flags: BACKEND_PRESENT | if spec.local { BACKEND_LOCAL } else { 0 },
        };
        let existing = &self.backend_slots;
        let id = match existing.iter().find(|(_, b)| b.addr == want.addr) {
            Some((&id, _)) => id,
            None => (0..MAX_BACKENDS)
                .find(|id| !existing.contains_key(id))
                .ok_or_else(|| anyhow!("all {MAX_BACKENDS} backend ids are in use"))?,
        };
        if existing.get(&id) != Some(&want) {
            self.backends.set(id, want, 0)?;
            self.backend_slots.insert(id, want);
        }
        Ok(id)
    }

    /// Sets the backends of a service: writes backend entries first, then only the
    /// ring slots that changed, then the service entry, and last removes backends
    /// no service uses any more (with their flows, so those re-hash). Each step
    /// leaves every slot pointing at a written backend. `backends` may be empty:
    /// the service then drops its traffic (counted as `drop_no_backend`).
    pub fn set_service(&mut self, addr: ServiceAddr, backends: &[BackendSpec], table_size: u32, seed: u64) -> Result<RingUpdate> {
        let start = Instant::now();
        maglev::check_table_size(table_size)?;
        let members: Vec<Member> =
            backends.iter().map(|b| Member { id: b.name.clone(), weight: b.weight.max(1) }).collect();
        let built = maglev::build(&members, table_size, seed)?;
        // Backend ids in `built.members` order (sorted by name).
        let mut ids = Vec::with_capacity(built.members.len());
        for m in &built.members {
            let spec = backends.iter().find(|b| b.name == m.id).expect("member from backends");
            ids.push(self.backend_id(spec)?);
        }
        let slots: Vec<u32> = if ids.is_empty() {
            vec![NO_BACKEND; table_size as usize]
        } else {
            built.slots.iter().map(|&i| ids[i as usize]).collect()
        };

        let key = addr.key();
        let current = self.services.get(&key, 0).ok();
        let id = match current {
            Some(s) => s.id,
            None => self.free_service_id()?,
        };
        let (offset, old) = match current {
            Some(s) if s.ring_size == table_size => (s.ring_offset, self.rings.get(&addr).cloned().unwrap_or_default()),
            _ => (self.ring_alloc.alloc(table_size)?, Vec::new()),
        };
        let changes = maglev::changed_slots(&old, &slots);
        for &(i, backend) in &changes {
            self.ring.set(offset + i, backend, 0)?;
        }
        let svc = Service { id, ring_offset: offset, ring_size: table_size, _pad: 0 };
        self.services.insert(key, svc, 0)?;
        if let Some(s) = current {
            if s.ring_offset != offset {
                self.ring_alloc.free(s.ring_offset, s.ring_size);
            }
        }
        let kept: BTreeSet<u32> = slots.iter().copied().collect();
        let lost_some = self.rings.get(&addr).is_some_and(|prev| prev.iter().any(|b| !kept.contains(b)));
        self.rings.insert(addr, slots);
        self.update_fragment_alias(addr.vip, addr.proto)?;
        let gone = self.collect_backends()?;
        // Cached answers may name a changed or removed backend; evict_flows bumps
        // again once the flows it removes are gone.
        self.epoch.bump()?;
        // One pass over the flow table, and only when some flow may have to move:
        // flows of this service pinned to a backend it no longer has, and flows to
        // backends no service has any more, re-hash.
        if lost_some || !gone.is_empty() {
            let (vip, port) = (key.vip, key.port);
            self.evict_flows(|k, f| {
                gone.contains(&f.backend)
                    || (k.dst == vip && k.proto == addr.proto && (k.dport == port || k.dport == [0, 0]) && !kept.contains(&f.backend))
            })?;
        }
        Ok(RingUpdate { slots_written: changes.len(), table_size, elapsed: start.elapsed() })
    }

    /// Removes a service, its ring and any backend only it used.
    pub fn remove_service(&mut self, addr: ServiceAddr) -> Result<()> {
        let key = addr.key();
        if let Ok(s) = self.services.get(&key, 0) {
            self.services.remove(&key)?;
            self.ring_alloc.free(s.ring_offset, s.ring_size);
            reset_counter(&mut self.service_stats, s.id)?;
        }
        self.rings.remove(&addr);
        self.update_fragment_alias(addr.vip, addr.proto)?;
        let gone = self.collect_backends()?;
        self.epoch.bump()?;
        if !gone.is_empty() {
            self.evict_flows(|_, f| gone.contains(&f.backend))?;
        }
        Ok(())
    }

    fn free_service_id(&self) -> Result<u32> {
        let used: BTreeSet<u32> = self.service_entries()?.iter().map(|(_, s)| s.id).collect();
        (0..MAX_SERVICES).find(|i| !used.contains(i)).ok_or_else(|| anyhow!("all {MAX_SERVICES} service ids are in use"))
    }

    /// Points (vip, port 0, proto), the entry fragments use, at the service with the
    /// lowest port of that VIP and protocol (or removes it when there is none).
    fn update_fragment_alias(&mut self, vip: Ipv4Addr, proto: u8) -> Result<()> {
        let alias = ServiceAddr { vip, port: 0, proto }.key();
        let first = self.rings.keys().find(|a| a.vip == vip && a.proto == proto && a.port != 0).copied();
        match first {
            Some(a) => {
                let svc = self.services.get(&a.key(), 0)?;
                self.services.insert(alias, svc, 0)?;
            }
            None => ignore_missing(self.services.remove(&alias))?,
        }
        Ok(())
    }

    /// Deletes backends no ring references and returns their ids; the caller
    /// evicts their flows (in the same pass as any other eviction it needs).
    fn collect_backends(&mut self) -> Result<BTreeSet<u32>> {
        let used: BTreeSet<u32> = self.rings.values().flatten().copied().collect();
        let gone: BTreeSet<u32> = self.backend_slots.keys().copied().filter(|id| !used.contains(id)).collect();
        for id in &gone {
            // A zeroed slot (no BACKEND_PRESENT) is no backend: flows to it re-hash.
            self.backends.set(*id, Backend::default(), 0)?;
            self.backend_slots.remove(id);
            reset_counter(&mut self.backend_stats, *id)?;
        }
        Ok(gone)
    }

    /// Removes flow-table entries matching `pred`; returns how many.
    pub fn evict_flows(&mut self, pred: impl Fn(&FlowKey, &Flow) -> bool) -> Result<usize> {
        let stale: Vec<FlowKey> = self.flows.iter().filter_map(|kv| kv.ok()).filter(|(k, f)| pred(k, f)).map(|(k, _)| k).collect();
        for k in &stale {
            ignore_missing(self.flows.remove(k))?;
        }
        self.epoch.bump()?; // cached copies of the removed flows
        Ok(stale.len())
    }

    /// The flow cache's epoch (`lb4_flow_cache_ctl`): bumped each time cached answers are invalidated.
    pub fn flow_cache_epoch(&self) -> Result<u64> {
        self.epoch.epoch()
    }

    pub fn flow_count(&self) -> usize {
        self.flows.keys().filter(|k| k.is_ok()).count()
    }

    /// Sums the per-CPU counters.
    pub fn counters(&self) -> Result<Counters> {
        let mut c = Counters::default();
        for r in Reason::ALL {
            c.reasons.insert(r.name(), sum(&self.stats, r as u32)?);
        }
        for (_, s) in self.service_entries()? {
            c.services.insert(s.id, sum(&self.service_stats, s.id)?);
        }
        for id in self.backends()?.into_keys() {
            c.backends.insert(id, sum(&self.backend_stats, id)?);
        }
        Ok(c)
    }

    /// One reason's counter (packets, bytes) summed over CPUs: cheap enough to poll.
    pub fn reason_count(&self, r: Reason) -> Result<(u64, u64)> {
        sum(&self.stats, r as u32)
    }

    /// Attaches the loaded program to `iface` (see [`attach::attach`]).
    pub fn attach(&mut self, iface: &str, mode: AttachMode) -> Result<attach::Attached> {
        let dir = self.dir.clone();
        let ebpf = self.ebpf.as_mut().ok_or_else(|| anyhow!("program not loaded by this process"))?;
        let a = attach::attach(ebpf, &dir, iface, mode)?;
        // The attach mode, when known, is recorded with the MAC (IFACE_NATIVE).
        let flags = a.mode.map(|m| if m == AttachMode::Native { IFACE_NATIVE } else { 0 });
        self.write_iface(a.ifindex, a.mac, flags)?;
        Ok(a)
    }
}

fn sum(map: &PerCpuArray<MapData, Counter>, i: u32) -> Result<(u64, u64)> {
    let v = map.get(&i, 0)?;
    Ok(v.iter().fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes)))
}

fn reset_counter(map: &mut PerCpuArray<MapData, Counter>, i: u32) -> Result<()> {
    let n = aya::util::nr_cpus().map_err(|(_, e)| e)?;
    map.set(i, aya::maps::PerCpuValues::try_from(vec![Counter::default(); n])?, 0)?;
    Ok(())
}

fn ignore_missing(r: Result<(), aya::maps::MapError>) -> Result<()> {
    match r {
        Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Makes sure `dir` is on a mounted bpffs and exists.
pub fn ensure_bpffs_dir(dir: &Path) -> Result<()> {
    let mut probe = dir.to_path_buf();
    while !probe.exists() {
        if !probe.pop() {
            break;
        }
    }
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid C string and out pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 || st.f_type as i64 != 0xcafe4a11 {
        bail!(
            "{} is not on a bpffs: mount one with `mount -t bpf bpf /sys/fs/bpf` (or run `cargo xtask setup`)",
            probe.display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}
