//! Batched map operations (`BPF_MAP_LOOKUP_BATCH`, `BPF_MAP_UPDATE_BATCH`, Linux
//! 5.6+): thousands of entries per system call instead of one or two each. aya
//! 0.14 has no wrapper for them; the attribute layout is the `batch` member of
//! `union bpf_attr` (include/uapi/linux/bpf.h). Used for whole-ring writes,
//! reading rings and the first-packet records back, which would otherwise cost
//! O(entries) calls.
use std::{
    io,
    mem::{size_of, MaybeUninit},
    os::fd::{AsFd as _, AsRawFd as _},
};

use aya::{maps::MapData, Pod};

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_long = 26;

/// Entries asked for per call.
const CHUNK: usize = 8192;

#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// The bpf(2) system call with `attr`, a `#[repr(C)]` prefix of `union bpf_attr`
/// for `cmd`; its result (a new fd for the commands that open one).
pub(super) fn sys_bpf<A>(cmd: libc::c_long, attr: &mut A) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, fully initialised bpf_attr prefix of the size given;
    // the kernel reads and writes only it and the buffers it points at, which the
    // callers keep alive and size for the command (`count` entries for the batches).
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut A, size_of::<A>()) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn fd(map: &MapData) -> u32 {
    map.fd().as_fd().as_raw_fd() as u32
}

/// Every (key, value) of a hash or array map (not per-CPU). Entries added or
/// removed during the walk may or may not be seen, as with `get_next_key`.
pub fn lookup_all<K: Pod, V: Pod>(map: &MapData) -> io::Result<Vec<(K, V)>> {
    let mut out = Vec::new();
    // The batch token: a bucket index for hash maps, a key for arrays; 8 bytes hold both.
    let mut token = [0u64; 2];
    let mut first = true;
    let mut chunk = CHUNK;
    loop {
        let mut keys: Vec<MaybeUninit<K>> = Vec::with_capacity(chunk);
        let mut values: Vec<MaybeUninit<V>> = Vec::with_capacity(chunk);
        let in_token = token;
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { in_token.as_ptr() as u64 },
            out_batch: token.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: chunk as u32,
            map_fd: fd(map),
            ..Default::default()
        };
        let r = sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = attr.count as usize;
        match &r {
            // A hash bucket holds more entries than asked for: ask for more.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && n == 0 => {
                chunk *= 2;
                continue;
            }
            Err(e) if e.raw_os_error() != Some(libc::ENOENT) => return Err(io::Error::new(e.kind(), format!("BPF_MAP_LOOKUP_BATCH: {e}"))),
            _ => {}
        }
        // SAFETY: the kernel wrote `n` keys and values (Pod: any bytes are valid).
        unsafe {
            keys.set_len(n);
            values.set_len(n);
        }
        out.extend(keys.into_iter().zip(values).map(|(k, v)| unsafe { (k.assume_init(), v.assume_init()) }));
        if r.is_err() {
            return Ok(out); // ENOENT: the walk is complete
        }
        first = false;
    }
}

/// Slots `start..start + len` of an array map (not per-CPU), in order: a ring
/// read back without reading the whole array.
pub fn array_range<V: Pod>(map: &MapData, start: u32, len: u32) -> io::Result<Vec<V>> {
    let mut out: Vec<V> = Vec::with_capacity(len as usize);
    while (out.len() as u32) < len {
        let next = start + out.len() as u32;
        let want = (len - out.len() as u32).min(CHUNK as u32);
        // The kernel starts after the key in `in_batch` (from the first without one).
        let prev = next.wrapping_sub(1);
        let mut token = 0u32;
        let mut keys: Vec<MaybeUninit<u32>> = Vec::with_capacity(want as usize);
        let mut values: Vec<MaybeUninit<V>> = Vec::with_capacity(want as usize);
        let mut attr = BatchAttr {
            in_batch: if next == 0 { 0 } else { &prev as *const u32 as u64 },
            out_batch: &mut token as *mut u32 as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: want,
            map_fd: fd(map),
            ..Default::default()
        };
        let r = sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr);
        let n = attr.count as usize;
        if let Err(e) = &r {
            if e.raw_os_error() != Some(libc::ENOENT) {
                return Err(io::Error::new(e.kind(), format!("BPF_MAP_LOOKUP_BATCH: {e}")));
            }
        }
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, format!("slots {next}.. are outside the array")));
        }
        // SAFETY: the kernel wrote `n` values (Pod: any bytes are valid).
        unsafe { values.set_len(n) };
        out.extend(values.into_iter().map(|v| unsafe { v.assume_init() }));
    }
    Ok(out)
}

/// Writes `entries` (key, value) in as few calls as the chunk size allows.
pub fn update<K: Pod, V: Pod>(map: &MapData, entries: &[(K, V)]) -> io::Result<()> {
    for part in entries.chunks(CHUNK) {
        let keys: Vec<K> = part.iter().map(|(k, _)| *k).collect();
        let values: Vec<V> = part.iter().map(|(_, v)| *v).collect();
        let mut attr =
            BatchAttr { keys: keys.as_ptr() as u64, values: values.as_ptr() as u64, count: part.len() as u32, map_fd: fd(map), ..Default::default() };
        sys_bpf(BPF_MAP_UPDATE_BATCH, &mut attr).map_err(|e| io::Error::new(e.kind(), format!("BPF_MAP_UPDATE_BATCH: {e}")))?;
    }
    Ok(())
}
