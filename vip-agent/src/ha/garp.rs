//! Gratuitous ARP on VIP takeover, from userspace: XDP only rewrites frames it
//! receives and cannot originate one.
//!
//! Form: an ARP *request* broadcast with sender IP = target IP = VIP, sender MAC =
//! our interface's MAC and target MAC zero — RFC 5227's "ARP Announcement". Linux
//! treats it as gratuitous (`arp_is_garp`: sip == tip) and overrides an existing
//! neighbour entry even within its `locktime`; a gratuitous *reply* is only taken as
//! such when the target MAC equals the sender MAC, and some hosts ignore unsolicited
//! replies. Nobody answers it (no host owns the target address but us). Receivers
//! with no entry for the VIP do not create one by default (`arp_accept=0`); they ARP
//! when they need it and the XDP program answers.
//!
//! Several copies, spaced, because a single frame can be lost and a switch may
//! still be learning the new port.
use std::{
    io,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

use vip_common::ETH_P_ARP;

/// Ethernet minimum (without FCS): the frame is padded here rather than relying
/// on every driver to pad a runt.
pub const GARP_FRAME_LEN: usize = 60;

/// The gratuitous ARP frame for `vip` from `mac` (Ethernet broadcast, zero-padded).
pub fn garp_frame(mac: [u8; 6], vip: Ipv4Addr) -> [u8; GARP_FRAME_LEN] {
    arp_request_frame(mac, vip, vip)
}

/// A broadcast ARP request from (`mac`, `spa`) for `tpa`, zero-padded.
pub fn arp_request_frame(mac: [u8; 6], spa: Ipv4Addr, tpa: Ipv4Addr) -> [u8; GARP_FRAME_LEN] {
    let mut f = [0u8; GARP_FRAME_LEN];
    f[0..6].copy_from_slice(&[0xff; 6]); // destination: broadcast
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&ETH_P_ARP.to_be_bytes());
    f[14..16].copy_from_slice(&1u16.to_be_bytes()); // htype Ethernet
    f[16..18].copy_from_slice(&0x0800u16.to_be_bytes()); // ptype IPv4
    f[18] = 6; // hlen
    f[19] = 4; // plen
    f[20..22].copy_from_slice(&1u16.to_be_bytes()); // op: request
    f[22..28].copy_from_slice(&mac); // sha
    f[28..32].copy_from_slice(&spa.octets());
    // tha (32..38) stays zero: unknown, as in any request.
    f[38..42].copy_from_slice(&tpa.octets()); // = spa: gratuitous
    f
}

/// Length of [`unsolicited_na_frame`]: Ethernet, IPv6, the advertisement and its
/// target link-layer address option.
pub const NA_FRAME_LEN: usize = 14 + 40 + 32;

/// The unsolicited Neighbor Advertisement for `vip` from `mac` (RFC 4861 7.2.6),
/// the IPv6 twin of gratuitous ARP: to all-nodes (ff02::1, 33:33:00:00:00:01),
/// from the VIP, hop limit 255, Override set so that neighbours replace the old
/// holder's MAC (Linux updates an existing entry and makes it STALE, then
/// confirms it by a solicitation the data path answers; it creates none),
/// Solicited clear, our MAC as the target link-layer address.
pub fn unsolicited_na_frame(mac: [u8; 6], vip: Ipv6Addr) -> [u8; NA_FRAME_LEN] {
    let all_nodes = Ipv6Addr::new(0xff02, 0, 0, 0, 0, 0, 0, 1);
    let mut f = [0u8; NA_FRAME_LEN];
    f[0..6].copy_from_slice(&[0x33, 0x33, 0, 0, 0, 1]);
    f[6..12].copy_from_slice(&mac);
    f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
    let ip = &mut f[14..];
    ip[0] = 0x60;
    ip[4..6].copy_from_slice(&32u16.to_be_bytes()); // payload length
    ip[6] = 58; // ICMPv6
    ip[7] = 255; // hop limit: RFC 4861 receivers drop anything else
    ip[8..24].copy_from_slice(&vip.octets());
    ip[24..40].copy_from_slice(&all_nodes.octets());
    let na = &mut ip[40..];
    na[0] = 136; // Neighbor Advertisement
    na[4] = 0x20; // Override
    na[8..24].copy_from_slice(&vip.octets());
    na[24] = 2; // target link-layer address, one 8-byte unit
    na[25] = 1;
    na[26..32].copy_from_slice(&mac);
    // The checksum covers the pseudo-header: addresses, length, next header.
    let mut sum: u32 = f[22..54].chunks(2).chain(f[54..].chunks(2)).map(|c| u32::from(u16::from_be_bytes([c[0], c[1]]))).sum();
    sum += 32 + 58;
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    f[56..58].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    f
}

/// The frame that announces `vip` from `mac`: gratuitous ARP for IPv4, an
/// unsolicited Neighbor Advertisement for IPv6.
pub fn announcement_frame(mac: [u8; 6], vip: IpAddr) -> Vec<u8> {
    match vip {
        IpAddr::V4(v) => garp_frame(mac, v).to_vec(),
        IpAddr::V6(v) => unsolicited_na_frame(mac, v).to_vec(),
    }
}

/// `frame` as it goes on the wire of a VLAN: with the 802.1Q tag `vid` after its
/// MAC addresses (none: unchanged). Frames of a VIP on a VLAN leave through the
/// VLAN's parent, where the program runs, so they carry the tag themselves.
pub fn tagged(frame: &[u8], vid: Option<u16>) -> Vec<u8> {
    let Some(vid) = vid else { return frame.to_vec() };
    let mut f = Vec::with_capacity(frame.len() + 4);
    f.extend_from_slice(&frame[..12]);
    f.extend_from_slice(&0x8100u16.to_be_bytes());
    f.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
    f.extend_from_slice(&frame[12..]);
    f
}

/// A send-only packet socket. Protocol 0 on creation: the kernel delivers no
/// received frames to it, so it costs nothing while idle.
pub struct GarpSocket {
    fd: OwnedFd,
}

impl GarpSocket {
    /// Needs CAP_NET_RAW; sends in the network namespace of the calling thread.
    pub fn new() -> io::Result<Self> {
        // SAFETY: plain syscall; the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nobody else owns.
        Ok(Self { fd: unsafe { OwnedFd::from_raw_fd(fd) } })
    }

    /// Sends one gratuitous ARP for `vip` out of `ifindex` with source `mac`.
    pub fn send(&self, ifindex: u32, mac: [u8; 6], vip: Ipv4Addr) -> io::Result<()> {
        self.send_frame(ifindex, &garp_frame(mac, vip))
    }

    /// Sends one broadcast ARP frame (Ethernet header included) out of `ifindex`.
    pub fn send_frame(&self, ifindex: u32, frame: &[u8]) -> io::Result<()> {
        // SAFETY: sockaddr_ll is plain data; all-zero is a valid starting value.
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = ETH_P_ARP.to_be();
        sll.sll_ifindex = ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&[0xff; 6]);
        // SAFETY: valid fd, buffer and address of the stated lengths.
        let n = unsafe {
            libc::sendto(
                self.fd.as_raw_fd(),
                frame.as_ptr().cast(),
                frame.len(),
                0,
                (&sll as *const libc::sockaddr_ll).cast(),
                std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
            )
        };
        match n {
            n if n < 0 => Err(io::Error::last_os_error()),
            n if n as usize != frame.len() => Err(io::Error::other(format!("short send: {n} bytes"))),
            _ => Ok(()),
        }
    }
}

/// Sends `count` gratuitous ARPs for `vip`, `interval` apart (no wait after the
/// last). Blocks (the agent sends from its own task, round by round over its VIPs).
pub fn send_garp(ifindex: u32, mac: [u8; 6], vip: Ipv4Addr, count: u32, interval: Duration) -> io::Result<()> {
    let s = GarpSocket::new()?;
    for i in 0..count {
        if i > 0 {
            std::thread::sleep(interval);
        }
        s.send(ifindex, mac, vip)?;
    }
    Ok(())
}

/// How the agent's ARP frames leave the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum ArpSender {
    /// `xdp` where the program is attached in native mode and the kernel lets the
    /// agent transmit through XDP (probed at start), else `packet`.
    Auto,
    /// Through the pinned `vip_xmit` program (BPF_PROG_RUN live frames): needs only
    /// CAP_BPF and CAP_NET_ADMIN; the driver must transmit XDP frames, and the
    /// kernel must allow it (the agent stops if it refuses).
    Xdp,
    /// A packet socket: any interface, needs CAP_NET_RAW.
    Packet,
}

/// The open transmit path.
pub enum FrameTx {
    /// Boxed: the program handle is large and the socket small.
    Xdp(Box<crate::dataplane::XdpXmit>),
    Packet(GarpSocket),
}

impl FrameTx {
    /// The sender `kind` asks for, on interfaces all attached natively or not
    /// (`native`), probed on `probe_ifindex`; `pin_dir` holds `vip_xmit`. `auto` takes XDP only where it
    /// works: native attachments whose kernel lets this process transmit through
    /// XDP (a probe that sends nothing); else the packet socket, saying why.
    /// Returns the sender and what it is.
    pub fn choose(kind: ArpSender, native: bool, probe_ifindex: u32, pin_dir: &std::path::Path) -> anyhow::Result<(Self, ArpSender)> {
        use anyhow::Context as _;
        let xdp = || -> anyhow::Result<Self> {
            let x = crate::dataplane::XdpXmit::open(pin_dir)?;
            x.probe(probe_ifindex).context("the kernel refused to transmit through XDP here")?;
            Ok(FrameTx::Xdp(Box::new(x)))
        };
        let packet = || GarpSocket::new().map(FrameTx::Packet).map_err(|e| anyhow::anyhow!("packet socket (needs CAP_NET_RAW): {e}"));
        match kind {
            ArpSender::Packet => Ok((packet()?, ArpSender::Packet)),
            ArpSender::Xdp => {
                if !native {
                    tracing::warn!("--arp-sender xdp on an interface attached in generic mode: the kernel may drop the agent's frames silently");
                }
                Ok((xdp().context("--arp-sender xdp; --arp-sender packet (with CAP_NET_RAW) works on any kernel")?, ArpSender::Xdp))
            }
            ArpSender::Auto if !native => {
                Ok((packet().context("the program runs in generic mode here, where XDP cannot transmit the agent's frames")?, ArpSender::Packet))
            }
            ArpSender::Auto => match xdp() {
                Ok(x) => Ok((x, ArpSender::Xdp)),
                Err(refused) => {
                    let p = packet().with_context(|| format!("{refused:#}, so a packet socket is needed"))?;
                    tracing::warn!("{refused:#}: gratuitous ARP and ARP checks go out through a packet socket");
                    Ok((p, ArpSender::Packet))
                }
            },
        }
    }

    pub fn send(&self, ifindex: u32, frame: &[u8]) -> anyhow::Result<()> {
        match self {
            FrameTx::Xdp(x) => x.send(ifindex, frame).map_err(|e| anyhow::Error::new(e).context("BPF_PROG_RUN")),
            FrameTx::Packet(s) => s.send_frame(ifindex, frame).map_err(Into::into),
        }
    }
}

/// Frames to send `rounds` times, `gap` apart: round by round, so every address's
/// first frame goes out at once. Each: (address, interface it leaves by, frame).
pub struct Job {
    pub frames: Vec<(IpAddr, u32, Vec<u8>)>,
    pub rounds: u32,
    pub gap: Duration,
    pub what: &'static str,
}

/// What the sender task is asked to do.
pub enum Order {
    Send(Job),
    /// Drop the frames still queued for these addresses: a VIP released while its
    /// takeover rounds were pending must not be claimed again by them (the new
    /// owner would count them as ARP conflicts and clients would be pulled back).
    Cancel(std::collections::BTreeSet<IpAddr>),
}

/// Starts the one task that sends the agent's ARP frames; jobs interleave (a
/// takeover's first round never waits behind another job's gaps). Returns the
/// queue; the task ends when it is dropped.
pub fn spawn_sender(tx: FrameTx) -> tokio::sync::mpsc::UnboundedSender<Order> {
    let (q, mut rx) = tokio::sync::mpsc::unbounded_channel::<Order>();
    tokio::spawn(async move {
        // (when the next round is due, the job, rounds left)
        let mut pending: Vec<(tokio::time::Instant, Job, u32)> = Vec::new();
        loop {
            let next = pending.iter().map(|p| p.0).min();
            let job = tokio::select! {
                j = rx.recv() => match j {
                    Some(j) => Some(j),
                    None => return,
                },
                _ = async { tokio::time::sleep_until(next.unwrap()).await }, if next.is_some() => None,
            };
            let now = tokio::time::Instant::now();
            match job {
                Some(Order::Send(j)) if !j.frames.is_empty() && j.rounds > 0 => pending.push((now, j, 0)),
                Some(Order::Cancel(addrs)) => {
                    for p in &mut pending {
                        p.1.frames.retain(|(a, _, _)| !addrs.contains(a));
                    }
                    pending.retain(|p| !p.1.frames.is_empty());
                }
                _ => {}
            }
            for p in pending.iter_mut().filter(|p| p.0 <= now) {
                for (addr, ifindex, frame) in &p.1.frames {
                    if let Err(e) = tx.send(*ifindex, frame) {
                        tracing::warn!(%addr, "{}: {e:#}", p.1.what);
                    }
                }
                p.2 += 1;
                p.0 = now + p.1.gap;
            }
            pending.retain(|p| p.2 < p.1.rounds);
        }
    });
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_byte_for_byte() {
        let mac = [0x02, 0x00, 0x5e, 0x10, 0x20, 0x30];
        let f = garp_frame(mac, Ipv4Addr::new(198, 18, 1, 100));
        #[rustfmt::skip]
        let want: [u8; 42] = [
            0xff, 0xff, 0xff, 0xff, 0xff, 0xff, // eth dst: broadcast
            0x02, 0x00, 0x5e, 0x10, 0x20, 0x30, // eth src
            0x08, 0x06,                         // ARP
            0x00, 0x01, 0x08, 0x00, 6, 4,       // Ethernet / IPv4, lengths
            0x00, 0x01,                         // request
            0x02, 0x00, 0x5e, 0x10, 0x20, 0x30, // sha
            198, 18, 1, 100,                    // spa
            0, 0, 0, 0, 0, 0,                   // tha
            198, 18, 1, 100,                    // tpa
        ];
        assert_eq!(f[..42], want);
        assert_eq!(f[42..], [0u8; GARP_FRAME_LEN - 42]);
        // In VLAN 42: the same frame with the tag after the MACs.
        let t = tagged(&f, Some(42));
        assert_eq!((&t[..12], &t[12..16], &t[16..]), (&f[..12], &[0x81, 0x00, 0x00, 42][..], &f[12..]));
        assert_eq!(tagged(&f, None), f);
    }
}
