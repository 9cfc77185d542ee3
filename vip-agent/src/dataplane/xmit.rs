//! Sending frames through the XDP program instead of a packet socket: the pinned
//! `vip_xmit` program returns XDP_TX, and BPF_PROG_RUN in live-frames mode with
//! the interface as ingress hands its frame to the driver's XDP transmit path.
//! That needs CAP_BPF and CAP_NET_ADMIN (which the agent has anyway), not
//! CAP_NET_RAW. It works where the driver can transmit XDP frames
//! (`ndo_xdp_xmit`): native XDP drivers, and veth when its peer has NAPI
//! (an XDP program or GRO); elsewhere the kernel drops the frame silently, so the
//! agent uses it only on interfaces attached in native mode. Some kernels refuse
//! live-frames runs outright (EPERM even for root; seen on a 6.18 build), so the
//! agent probes first ([`XdpXmit::probe`]) and falls back to a packet socket.
use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context as _, Result};
use aya::{
    programs::{ProgramError, TestRun, TestRunAttrs, TestRunOptions, Xdp},
    Ebpf,
};
use vip_common::XMIT_PROGRAM_NAME;

/// `struct xdp_md` (linux/bpf.h) as BPF_PROG_RUN takes it for context: offsets
/// into the frame, and the interface the frame is taken to have arrived on (a live
/// frame leaves through it).
#[repr(C)]
#[derive(Default)]
struct XdpMd {
    data: u32,
    data_end: u32,
    data_meta: u32,
    ingress_ifindex: u32,
    rx_queue_index: u32,
    egress_ifindex: u32,
}

impl XdpMd {
    fn bytes(&self) -> &[u8] {
        // SAFETY: repr(C), six u32 fields, no padding.
        unsafe { std::slice::from_raw_parts((self as *const Self).cast::<u8>(), std::mem::size_of::<Self>()) }
    }
}

fn pin_path(dir: &Path) -> PathBuf {
    dir.join(XMIT_PROGRAM_NAME)
}

/// Loads `vip_xmit` and pins it under `dir` (replacing an older pin, so an
/// upgraded agent sends through its own program).
pub(super) fn load_and_pin(ebpf: &mut Ebpf, dir: &Path) -> Result<()> {
    let prog: &mut Xdp = ebpf.program_mut(XMIT_PROGRAM_NAME).ok_or_else(|| anyhow!("program {XMIT_PROGRAM_NAME} missing from the object"))?.try_into()?;
    prog.load().context("the kernel verifier rejected the xmit program")?;
    let pin = pin_path(dir);
    if pin.exists() {
        std::fs::remove_file(&pin).with_context(|| format!("replacing {}", pin.display()))?;
    }
    prog.pin(&pin).with_context(|| format!("pinning {}", pin.display()))?;
    Ok(())
}

/// A handle on the pinned `vip_xmit` program; owned by whichever task sends.
pub struct XdpXmit {
    prog: Xdp,
}

impl XdpXmit {
    /// Opens the program pinned under `dir` by [`super::Dataplane::load`].
    pub fn open(dir: &Path) -> Result<Self> {
        let pin = pin_path(dir);
        let prog = Xdp::from_pin(&pin, aya_obj::programs::XdpAttachType::Interface)
            .with_context(|| format!("opening {} (loaded by `vip-agent run`)", pin.display()))?;
        Ok(Self { prog })
    }

    /// Transmits `frame` (Ethernet header included) out of `ifindex`, in the
    /// network namespace of the calling thread.
    pub fn send(&self, ifindex: u32, frame: &[u8]) -> Result<(), ProgramError> {
        let ctx = XdpMd { data_end: frame.len() as u32, ingress_ifindex: ifindex, ..Default::default() };
        let mut opts = TestRunOptions::new();
        opts.data_in = Some(frame);
        opts.ctx_in = Some(ctx.bytes());
        opts.repeat = 1;
        opts.attrs = TestRunAttrs::new().xdp_live_frames(1);
        self.prog.test_run(opts).map(|_| ())
    }

    /// Whether the kernel lets this process transmit through XDP on `ifindex`:
    /// one live-frames run of a header-only frame, which `vip_xmit` drops, so
    /// nothing leaves the node.
    pub fn probe(&self, ifindex: u32) -> Result<()> {
        self.send(ifindex, &[0u8; vip_common::XMIT_PROBE_LEN]).map_err(|e| anyhow::Error::new(e).context("BPF_PROG_RUN in live-frames mode"))
    }
}
