//! A raw-frame tap for hosts the lab kernel cannot give a VLAN interface: sends
//! frames as built (tags included) and receives every frame with its 802.1Q tag,
//! which the kernel moves out of received frames into packet metadata
//! (PACKET_AUXDATA) before any socket sees them.
use std::{
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

/// A packet socket on one interface of the calling thread's namespace.
pub struct Tap {
    fd: OwnedFd,
    ifindex: u32,
}

/// A received frame: its bytes as the kernel hands them (tag removed) and the
/// VLAN id it carried, if any.
pub struct Seen {
    pub frame: Vec<u8>,
    pub vlan: Option<u16>,
}

impl Tap {
    /// Opens a tap on `iface` (in the calling thread's network namespace).
    pub fn open(iface: &str) -> Result<Self> {
        let name = std::ffi::CString::new(iface)?;
        // SAFETY: a NUL-terminated name.
        let ifindex = unsafe { libc::if_nametoindex(name.as_ptr()) };
        if ifindex == 0 {
            bail!("no interface {iface}");
        }
        let all = (libc::ETH_P_ALL as u16).to_be();
        // SAFETY: plain socket(2); the fd is owned below.
        let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, i32::from(all)) };
        if fd < 0 {
            bail!("packet socket: {}", std::io::Error::last_os_error());
        }
        // SAFETY: a fresh fd nobody else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = all;
        sll.sll_ifindex = ifindex as i32;
        let one: libc::c_int = 1;
        let tv = libc::timeval { tv_sec: 0, tv_usec: 20_000 };
        // SAFETY: valid fd, address and options of the stated sizes.
        unsafe {
            if libc::bind(fd.as_raw_fd(), (&raw const sll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32) != 0 {
                bail!("bind: {}", std::io::Error::last_os_error());
            }
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_PACKET, libc::PACKET_AUXDATA, (&raw const one).cast(), 4);
            libc::setsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&raw const tv).cast(), std::mem::size_of::<libc::timeval>() as u32);
        }
        Ok(Self { fd, ifindex })
    }

    /// Sends `frame` as it is.
    pub fn send(&self, frame: &[u8]) -> Result<()> {
        let mut sll: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_ifindex = self.ifindex as i32;
        sll.sll_halen = 6;
        sll.sll_addr[..6].copy_from_slice(&frame[..6]);
        // SAFETY: valid fd, buffer and address.
        let n = unsafe {
            libc::sendto(self.fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0, (&raw const sll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32)
        };
        if n < 0 {
            bail!("sendto: {}", std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Frames received for `span` that `keep` accepts (frames this tap's host sent
    /// are left out).
    pub fn collect(&self, span: Duration, mut keep: impl FnMut(&Seen) -> bool) -> Vec<Seen> {
        let end = Instant::now() + span;
        let mut out = Vec::new();
        while Instant::now() < end {
            if let Some(s) = self.recv() {
                if keep(&s) {
                    out.push(s);
                }
            }
        }
        out
    }

    /// One received frame (None on timeout, or a frame we sent).
    fn recv(&self) -> Option<Seen> {
        let mut buf = [0u8; 2048];
        let mut ctl = [0u64; 16];
        let mut from: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
        let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_name = (&raw mut from).cast();
        msg.msg_namelen = std::mem::size_of::<libc::sockaddr_ll>() as u32;
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = ctl.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(&ctl);
        // SAFETY: every pointer in msg is valid for its stated length.
        let n = unsafe { libc::recvmsg(self.fd.as_raw_fd(), &raw mut msg, 0) };
        if n <= 0 || from.sll_pkttype == libc::PACKET_OUTGOING {
            return None;
        }
        let mut vlan = None;
        // SAFETY: walking the control messages the kernel wrote, with its macros.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&raw const msg);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                    let aux = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::tpacket_auxdata);
                    if aux.tp_status & libc::TP_STATUS_VLAN_VALID != 0 {
                        vlan = Some(aux.tp_vlan_tci & 0x0fff);
                    }
                }
                c = libc::CMSG_NXTHDR(&raw const msg, c);
            }
        }
        Some(Seen { frame: buf[..n as usize].to_vec(), vlan })
    }
}
