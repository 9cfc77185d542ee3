//! Attaching the program to an interface through a pinned bpf_link, so that the
//! attachment outlives the agent process (hitless restarts) and detaching is
//! removing the pin.
use std::{
    ffi::CString,
    path::{Path, PathBuf},
};

use anyhow::{anyhow, bail, Context as _, Result};
use aya::{
    programs::{
        links::{FdLink, PinnedLink},
        xdp::XdpLink,
        Xdp, XdpMode,
    },
    Ebpf,
};
use vip_common::PROGRAM_NAME;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
pub enum AttachMode {
    /// Native (driver) XDP, falling back to generic when the driver has none; generic
    /// on a veth, which delivers native XDP transmits only while its peer runs XDP or GRO.
    // `auto_avoids_native` decides which interfaces take generic.
    Auto,
    /// Native XDP only.
    Native,
    /// Generic (skb) XDP only.
    Generic,
}

#[derive(Clone, Debug)]
pub struct Attached {
    pub ifindex: u32,
    pub mac: [u8; 6],
    /// None when an earlier agent's attachment was found and kept.
    pub mode: Option<AttachMode>,
}

fn link_pin(dir: &Path, iface: &str) -> PathBuf {
    dir.join("links").join(iface)
}

/// ifindex and MAC of `iface` in the calling thread's network namespace.
pub fn iface_info(iface: &str) -> Result<(u32, [u8; 6])> {
    let c = CString::new(iface)?;
    // SAFETY: valid C string.
    let ifindex = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if ifindex == 0 {
        bail!("no interface named {iface:?} in this network namespace");
    }
    // SIOCGIFHWADDR rather than /sys/class/net: sysfs may belong to another netns.
    // SAFETY: plain socket/ioctl with a zeroed ifreq whose name fits (checked).
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            bail!("socket: {}", std::io::Error::last_os_error());
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        let name = iface.as_bytes();
        if name.len() >= ifr.ifr_name.len() {
            libc::close(fd);
            bail!("interface name {iface:?} too long");
        }
        for (d, s) in ifr.ifr_name.iter_mut().zip(name) {
            *d = *s as libc::c_char;
        }
        let r = libc::ioctl(fd, libc::SIOCGIFHWADDR, &mut ifr);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if r < 0 {
            bail!("reading the MAC of {iface}: {err}");
        }
        let sa = ifr.ifr_ifru.ifru_hwaddr.sa_data;
        Ok((ifindex, [sa[0] as u8, sa[1] as u8, sa[2] as u8, sa[3] as u8, sa[4] as u8, sa[5] as u8]))
    }
}

/// Whether `iface` (by index) can carry frames: administratively up and with a
/// carrier (`IFF_UP` and `IFF_RUNNING`), in the calling thread's network namespace.
/// A missing interface is down.
pub fn link_up(ifindex: u32) -> bool {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: a buffer of IF_NAMESIZE, as if_indextoname requires; then a plain
    // socket/ioctl with a zeroed ifreq holding that (NUL-terminated) name.
    unsafe {
        if libc::if_indextoname(ifindex, name.as_mut_ptr()).is_null() {
            return false;
        }
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return true; // cannot tell: assume the link as it was configured
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        ifr.ifr_name[..name.len()].copy_from_slice(&name);
        let r = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut ifr);
        libc::close(fd);
        if r < 0 {
            return false;
        }
        let flags = ifr.ifr_ifru.ifru_flags as libc::c_int;
        flags & libc::IFF_UP != 0 && flags & libc::IFF_RUNNING != 0
    }
}

/// Makes `iface` hand 802.1Q tags to XDP inside the frame: receive VLAN stripping
/// (`rxvlan`, which moves the tag into the driver's descriptor or skb metadata,
/// where neither native nor generic XDP sees it) is turned off. Without that a
/// VLAN's frames look untagged to the program, and a VIP would be answered on
/// every VLAN. The kernel untags in software for VLAN sub-interfaces instead.
/// Ok(false): the driver cannot turn it off (the caller reports it).
pub fn keep_vlan_tags(iface: &str) -> Result<bool> {
    // Legacy ethtool flags (include/uapi/linux/ethtool.h): ETHTOOL_GFLAGS and
    // ETHTOOL_SFLAGS with ETH_FLAG_RXVLAN, mapped by the kernel to the
    // rx-vlan-hw-parse feature.
    const ETHTOOL_GFLAGS: u32 = 0x25;
    const ETHTOOL_SFLAGS: u32 = 0x26;
    const ETH_FLAG_RXVLAN: u32 = 1 << 8;
    #[repr(C)]
    struct EthtoolValue {
        cmd: u32,
        data: u32,
    }
    let name = CString::new(iface)?;
    anyhow::ensure!(name.as_bytes().len() < libc::IF_NAMESIZE, "interface name {iface:?} too long");
    // SAFETY: a plain socket and SIOCETHTOOL ioctls with a zeroed ifreq holding
    // the NUL-terminated name and a pointer to an ethtool_value that outlives them.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let mut v = EthtoolValue { cmd: ETHTOOL_GFLAGS, data: 0 };
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
            *d = *s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&raw mut v).cast();
        let mut r = libc::ioctl(fd, SIOCETHTOOL, &mut ifr);
        let mut err = std::io::Error::last_os_error();
        if r == 0 && v.data & ETH_FLAG_RXVLAN != 0 {
            v = EthtoolValue { cmd: ETHTOOL_SFLAGS, data: v.data & !ETH_FLAG_RXVLAN };
            r = libc::ioctl(fd, SIOCETHTOOL, &mut ifr);
            err = std::io::Error::last_os_error();
        }
        libc::close(fd);
        match r {
            0 => Ok(true),
            // No ethtool support (lo, some virtual devices): nothing strips tags.
            _ if err.raw_os_error() == Some(libc::EOPNOTSUPP) && v.cmd == ETHTOOL_GFLAGS => Ok(true),
            // A driver whose stripping is fixed on refuses the change.
            _ if err.raw_os_error() == Some(libc::EINVAL) || err.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(false),
            _ => Err(anyhow!("ethtool flags of {iface}: {err}")),
        }
    }
}

const SIOCETHTOOL: libc::c_ulong = 0x8946;

/// The name of `iface`'s driver (`ETHTOOL_GDRVINFO`), e.g. "veth", "mlx5_core".
pub fn driver(iface: &str) -> Result<String> {
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    /// struct ethtool_drvinfo (include/uapi/linux/ethtool.h).
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 32 * 4 + 12 + 4 * 5],
    }
    let name = CString::new(iface)?;
    anyhow::ensure!(name.as_bytes().len() < libc::IF_NAMESIZE, "interface name {iface:?} too long");
    let mut info = DrvInfo { cmd: ETHTOOL_GDRVINFO, driver: [0; 32], rest: [0; 32 * 4 + 12 + 4 * 5] };
    // SAFETY: a plain socket and one SIOCETHTOOL ioctl with a zeroed ifreq holding
    // the NUL-terminated name and a pointer to an ethtool_drvinfo that outlives it.
    let r = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        anyhow::ensure!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(name.as_bytes()) {
            *d = *s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&raw mut info).cast();
        let r = libc::ioctl(fd, SIOCETHTOOL, &mut ifr);
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        (r, err)
    };
    if r.0 < 0 {
        bail!("driver of {iface}: {}", r.1);
    }
    let end = info.driver.iter().position(|b| *b == 0).unwrap_or(info.driver.len());
    Ok(String::from_utf8_lossy(&info.driver[..end]).into_owned())
}

/// Why `auto` must not take native XDP on `iface`, if it must not. A veth's
/// native XDP_TX (and the frame sender's transmits) are delivered only while the
/// peer runs an XDP program or GRO (the peer's NAPI), which this side cannot see
/// or ensure: on a container-as-node link (kind) they are silently dropped, and
/// no ARP reply or forwarded frame leaves. Generic XDP transmits through the stack.
pub fn auto_avoids_native(iface: &str) -> Option<&'static str> {
    match driver(iface).ok()?.as_str() {
        "veth" => Some("a veth delivers native XDP transmits only while its peer runs XDP or GRO, which cannot be checked from here"),
        _ => None,
    }
}

pub fn attach(ebpf: &mut Ebpf, dir: &Path, iface: &str, mode: AttachMode) -> Result<Attached> {
    let (ifindex, mac) = iface_info(iface)?;
    let pin = link_pin(dir, iface);
    let prog: &mut Xdp = ebpf.program_mut(PROGRAM_NAME).ok_or_else(|| anyhow!("no program"))?.try_into()?;
    pin_program(prog, dir)?;
    if pin.exists() {
        match PinnedLink::from_pin(&pin) {
            // Still attached from an earlier agent: the link (and its mode) is
            // kept, and this agent's program replaces the one it runs, atomically
            // (BPF_LINK_UPDATE): no gap in forwarding, and an upgrade's program
            // takes effect. The maps are the same pins.
            Ok(p) => {
                let link = XdpLink::try_from(FdLink::from(p)).with_context(|| format!("{} is not an XDP link", pin.display()))?;
                let id = prog.attach_to_link(link).with_context(|| format!("replacing the program of the link pinned at {}", pin.display()))?;
                drop(prog.take_link(id)?); // the pin keeps it
                return Ok(Attached { ifindex, mac, mode: None });
            }
            Err(_) => std::fs::remove_file(&pin).with_context(|| format!("removing stale {}", pin.display()))?,
        }
    }
    let (id, used) = match mode {
        AttachMode::Native => (prog.attach(iface, XdpMode::Driver)?, AttachMode::Native),
        AttachMode::Generic => (prog.attach(iface, XdpMode::Skb)?, AttachMode::Generic),
        AttachMode::Auto => match auto_avoids_native(iface) {
            Some(why) => {
                tracing::info!(%iface, "generic XDP: {why} (--mode native overrides)");
                (prog.attach(iface, XdpMode::Skb)?, AttachMode::Generic)
            }
            None => match prog.attach(iface, XdpMode::Driver) {
                Ok(id) => (id, AttachMode::Native),
                Err(e) => {
                    tracing::info!(%iface, error = %e, "native XDP unavailable, using generic");
                    (prog.attach(iface, XdpMode::Skb)?, AttachMode::Generic)
                }
            },
        },
    };
    let link = prog.take_link(id)?;
    let fd_link = FdLink::try_from(link).context("XDP attachment is not a bpf_link (kernel too old?)")?;
    std::fs::create_dir_all(pin.parent().expect("has parent"))?;
    fd_link.pin(&pin).with_context(|| format!("pinning the link at {}", pin.display()))?;
    Ok(Attached { ifindex, mac, mode: Some(used) })
}

/// Pins `prog` under `dir` (replacing an earlier agent's, which a link update
/// leaves unused), so that `bpftool prog show pinned` finds the running one.
fn pin_program(prog: &mut Xdp, dir: &Path) -> Result<()> {
    let prog_pin = dir.join(PROGRAM_NAME);
    if prog_pin.exists() {
        std::fs::remove_file(&prog_pin).with_context(|| format!("replacing {}", prog_pin.display()))?;
    }
    prog.pin(&prog_pin).with_context(|| format!("pinning the program at {}", prog_pin.display()))
}

/// Detaches from `iface` by removing the link pin (the kernel drops the link with
/// its last reference). Returns whether there was an attachment.
pub fn detach(dir: &Path, iface: &str) -> Result<bool> {
    let pin = link_pin(dir, iface);
    if !pin.exists() {
        return Ok(false);
    }
    link_detach(&pin)?;
    std::fs::remove_file(&pin).with_context(|| format!("removing {}", pin.display()))?;
    Ok(true)
}

/// Detaches the link pinned at `pin` now (BPF_LINK_DETACH): removing the pin alone
/// frees the link, and so detaches the program, only when the kernel's deferred
/// release gets to it, after `detach` has said it was done.
fn link_detach(pin: &Path) -> Result<()> {
    use std::os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    };
    const BPF_OBJ_GET: libc::c_long = 7;
    const BPF_LINK_DETACH: libc::c_long = 34;
    // The leading fields of `union bpf_attr` for these two commands.
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
    }
    #[repr(C)]
    struct LinkDetach {
        link_fd: u32,
    }
    let path = CString::new(pin.as_os_str().as_bytes()).context("a pin path with a NUL byte")?;
    let mut get = ObjGet { pathname: path.as_ptr() as u64, bpf_fd: 0, file_flags: 0 };
    let fd = super::batch::sys_bpf(BPF_OBJ_GET, &mut get).with_context(|| format!("opening the link pinned at {}", pin.display()))?;
    // SAFETY: the kernel just returned this fd; owning it closes it on every path.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut detach = LinkDetach { link_fd: fd.as_raw_fd() as u32 };
    super::batch::sys_bpf(BPF_LINK_DETACH, &mut detach).with_context(|| format!("detaching the link pinned at {}", pin.display()))?;
    Ok(())
}

/// The interfaces with a link pinned under `dir` (`detach --all`), sorted.
pub fn pinned_links(dir: &Path) -> Result<Vec<String>> {
    let links = dir.join("links");
    let mut names = Vec::new();
    match std::fs::read_dir(&links) {
        Ok(rd) => {
            for e in rd {
                names.push(e.with_context(|| format!("reading {}", links.display()))?.file_name().to_string_lossy().into_owned());
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("reading {}", links.display())),
    }
    names.sort();
    Ok(names)
}
