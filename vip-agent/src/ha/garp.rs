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
    net::Ipv4Addr,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::Duration,
};

/// Ethernet minimum (without FCS): the frame is padded here rather than relying
/// on every driver to pad a runt.
pub const GARP_FRAME_LEN: usize = 60;

const ETH_P_ARP: u16 = 0x0806;

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
    }
}
