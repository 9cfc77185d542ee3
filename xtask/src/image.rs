//! `cargo xtask image`: OCI image archives of the agent and of the cluster tests'
//! pod binary, written here without a registry, a base image or a container build.
//!
//! Each image is one gzip layer holding a binary and exactly what the dynamic
//! loader needs to start it on this machine's glibc (its shared libraries and the
//! loader itself), no shell and no package manager. The archive is an OCI image
//! layout in a tar (`oci-layout`, `index.json`, `blobs/sha256/...`), the format
//! `ctr images import`, `podman load` and `skopeo copy oci-archive:` read. For one
//! commit and the same binaries the archive is byte-identical: every mtime is the
//! commit's time, owners are 0, JSON keys are sorted and gzip carries no mtime.
//!
//! The agent's layer is also written as a directory (`vip-agent.rootfs`), the build
//! context of `deploy/Containerfile`, which makes the same image with podman,
//! buildah or docker (e.g. to push and sign it with a registry's tooling).
use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, ensure, Context as _, Result};
use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

const MT_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MT_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const EPOCH: &str = "1970-01-01T00:00:00Z";
/// Every file and directory of a layer: executables and shared objects alike are
/// readable and executable by all.
const MODE: u32 = 0o755;

/// What goes into one image.
pub struct Spec {
    /// Repository part of the reference, e.g. `localhost/vip-agent`.
    pub name: String,
    /// Tag, e.g. `0.2.0`.
    pub tag: String,
    /// (file on this machine, absolute path in the image); symlinks are followed
    /// and stored as regular files.
    pub files: Vec<(PathBuf, String)>,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
    /// OCI annotations, written to the manifest and as labels to the config.
    pub annotations: BTreeMap<String, String>,
    /// The image's creation time as RFC 3339, and in seconds since the epoch as
    /// every file's mtime.
    pub created: String,
    pub mtime: i64,
}

/// The written archive: where, its full reference, manifest digest and size.
pub struct Written {
    pub path: PathBuf,
    pub reference: String,
    pub digest: String,
    pub size: u64,
}

/// Where `cargo xtask image` writes by default and the cluster tests read.
pub fn default_dir() -> PathBuf {
    crate::root().join("target/images")
}

/// The release binaries (the XDP object they embed must be built), then both archives in `out`.
pub fn image(out: &Path) -> Result<()> {
    crate::build_agent()?;
    crate::run(crate::cargo(None).args(["build", "--release", "-p", "vip-tests", "--bin", "vip-testpod"]), "build the vip-testpod binary")?;
    let release = crate::root().join("target/release");
    let git = Git::read();
    let version = env!("CARGO_PKG_VERSION");

    let agent = release.join("vip-agent");
    // The agent runs no external program (it talks rtnetlink, bpf(2) and the API
    // server itself) and reads no /etc file: its in-cluster client trusts the
    // service account's ca.crt only, so no CA bundle, and it neither resolves user
    // names nor needs NSS modules (glibc >= 2.34 has files/dns built in, and the
    // runtime provides /etc/hosts and /etc/resolv.conf). Hence: binary + libraries.
    let mut files = vec![(agent.clone(), "/usr/local/bin/vip-agent".to_owned())];
    files.extend(runtime_libraries(&agent)?);
    let agent_spec = Spec {
        name: "localhost/vip-agent".into(),
        tag: version.into(),
        files,
        entrypoint: vec!["/usr/local/bin/vip-agent".into()],
        cmd: vec![],
        annotations: git.annotations("vip-agent", "vip node agent: XDP virtual IP load balancer for Kubernetes", version),
        created: git.created.clone(),
        mtime: git.time,
    };

    let testpod = release.join("vip-testpod");
    let mut files = vec![(testpod.clone(), "/vip-testpod".to_owned())];
    files.extend(runtime_libraries(&testpod)?);
    let testpod_spec = Spec {
        name: "localhost/vip-testpod".into(),
        tag: "1".into(),
        files,
        entrypoint: vec!["/vip-testpod".into()],
        cmd: vec![],
        annotations: git.annotations("vip-testpod", "vip's cluster tests: pause process, TCP echo and HTTP server", version),
        created: git.created.clone(),
        mtime: git.time,
    };

    fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let rootfs = out.join(AGENT_ROOTFS);
    write_rootfs(&agent_spec, &rootfs)?;
    let podman = podman_build(&agent_spec, &rootfs);
    for (spec, file) in [(agent_spec, "vip-agent.oci.tar"), (testpod_spec, "vip-testpod.oci.tar")] {
        let w = write_archive(&spec, &out.join(file))?;
        println!("{}  {}  {}  {:.1} MiB", w.reference, w.digest, w.path.display(), w.size as f64 / (1024.0 * 1024.0));
    }
    println!("{}  the agent's files, for deploy/Containerfile; the same image from them:\n  {podman}", rootfs.display());
    if git.dirty {
        eprintln!("xtask: the work tree has uncommitted changes: revision {} (the images need not be reproducible)", git.revision.as_deref().unwrap_or("?"));
    }
    Ok(())
}

/// The agent image's file tree beside the archives (`write_rootfs`).
const AGENT_ROOTFS: &str = "vip-agent.rootfs";

/// The `podman build` of `deploy/Containerfile` that makes `spec`'s image from
/// `rootfs`: its labels through the Containerfile's build arguments, and the
/// commit's time for every file and the image (`--timestamp`).
fn podman_build(spec: &Spec, rootfs: &Path) -> String {
    let label = |k: &str| spec.annotations.get(&format!("org.opencontainers.image.{k}")).map(String::as_str).unwrap_or_default();
    let mut c = String::from("podman build -f deploy/Containerfile");
    for (arg, key) in [("VERSION", "version"), ("REVISION", "revision"), ("CREATED", "created"), ("SOURCE", "source")] {
        c += &format!(" --build-arg {arg}={}", shell_quote(label(key)));
    }
    c + &format!(" --timestamp {} -t {}:{} {}", spec.mtime, spec.name, spec.tag, shell_quote(&rootfs.display().to_string()))
}

/// `s` as one word for sh (single quotes unless it is plain).
fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_./:=@+,".contains(c)) {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

/// The commit the images are built from.
struct Git {
    revision: Option<String>,
    source: Option<String>,
    dirty: bool,
    /// The commit's time (0 outside a git checkout), in seconds and as RFC 3339 UTC.
    time: i64,
    created: String,
}

impl Git {
    fn read() -> Self {
        let git = |args: &[&str]| {
            // TZ=UTC: `format-local` dates in UTC.
            let o = Command::new("git").args(args).env("TZ", "UTC").current_dir(crate::root()).output().ok()?;
            o.status.success().then(|| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        };
        let Some(commit) = git(&["rev-parse", "HEAD"]) else {
            eprintln!("xtask: not a git checkout: the images carry no revision and the epoch as their time");
            return Self { revision: None, source: None, dirty: false, time: 0, created: EPOCH.into() };
        };
        // Untracked files (build output) do not make the tree dirty, as for `git describe --dirty`.
        let dirty = git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty());
        let time = git(&["log", "-1", "--format=%ct"]).and_then(|t| t.parse().ok()).unwrap_or(0);
        let created =
            git(&["-c", "log.showSignature=false", "log", "-1", "--date=format-local:%Y-%m-%dT%H:%M:%SZ", "--format=%cd"]).unwrap_or_else(|| EPOCH.into());
        Self {
            revision: Some(if dirty { format!("{commit}-dirty") } else { commit }),
            source: git(&["remote", "get-url", "origin"]).filter(|u| !u.is_empty()).map(|u| without_credentials(&u)),
            dirty,
            time,
            created,
        }
    }

    fn annotations(&self, title: &str, description: &str, version: &str) -> BTreeMap<String, String> {
        let mut a = BTreeMap::new();
        let mut put = |k: &str, v: &str| a.insert(format!("org.opencontainers.image.{k}"), v.to_owned());
        put("title", title);
        put("description", description);
        put("version", version);
        put("created", &self.created);
        put("licenses", env!("CARGO_PKG_LICENSE"));
        if let Some(r) = &self.revision {
            put("revision", r);
        }
        if let Some(s) = &self.source {
            put("source", s);
        }
        a
    }
}

/// A remote URL without a `user:token@` part.
fn without_credentials(url: &str) -> String {
    match (url.find("://"), url.find('@')) {
        (Some(s), Some(at)) if at > s => format!("{}{}", &url[..s + 3], &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// The shared libraries `binary` loads, each at the path this machine's loader
/// resolves it to, and the loader itself at the path the binary's PT_INTERP names.
///
/// `ldd` (the loader in trace mode) is the robust way: it follows the transitive
/// DT_NEEDED entries with the loader's own search rules (RUNPATH, ld.so.cache,
/// multiarch dirs), which re-implementing would get subtly wrong. PT_INTERP is read
/// from the ELF because that exact path is what the kernel opens.
pub fn runtime_libraries(binary: &Path) -> Result<Vec<(PathBuf, String)>> {
    let data = fs::read(binary).with_context(|| format!("reading {}", binary.display()))?;
    let interp = interpreter(&data).with_context(|| format!("reading the ELF program headers of {}", binary.display()))?;
    let o = Command::new("ldd").arg(binary).output().context("starting ldd (Debian package libc-bin)")?;
    let text = String::from_utf8_lossy(&o.stdout);
    if !o.status.success() {
        bail!("ldd {} failed: {}{}", binary.display(), text, String::from_utf8_lossy(&o.stderr));
    }
    let mut libs = Vec::new();
    if let Some(interp) = &interp {
        libs.push((PathBuf::from(interp), interp.clone()));
    }
    for line in text.lines().map(str::trim) {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)"; the vDSO and the
        // loader (already added) have no "=>".
        let Some((soname, rest)) = line.split_once(" => ") else { continue };
        let path = rest.split(" (").next().unwrap_or_default().trim();
        ensure!(path.starts_with('/'), "ldd {}: {soname} {}", binary.display(), if path.is_empty() { "not found" } else { path });
        if interp.as_deref() != Some(path) {
            libs.push((PathBuf::from(path), path.to_owned()));
        }
    }
    Ok(libs)
}

/// The PT_INTERP path of an ELF executable (None when statically linked).
fn interpreter(data: &[u8]) -> Result<Option<String>> {
    use object::{
        elf,
        read::elf::{ElfFile64, FileHeader as _, ProgramHeader as _},
        Endianness,
    };
    let file = ElfFile64::<Endianness>::parse(data)?;
    let endian = file.endian();
    for ph in file.elf_header().program_headers(endian, data)? {
        if ph.p_type(endian) == elf::PT_INTERP {
            let raw = ph.data(endian, data).map_err(|()| anyhow::anyhow!("PT_INTERP out of bounds"))?;
            let s = std::str::from_utf8(raw.split(|&b| b == 0).next().unwrap_or_default())?;
            return Ok(Some(s.to_owned()));
        }
    }
    Ok(None)
}

/// The OCI platform of the binaries built here (this machine's).
fn architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        "powerpc64" => "ppc64le",
        other => other,
    }
}

/// A tar header with the fixed owner, mode and time every entry gets.
fn header(kind: tar::EntryType, size: u64, mode: u32, mtime: i64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_size(size);
    h.set_mode(mode);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime.max(0) as u64);
    h
}

/// An image's files and directories, both in path order.
struct Tree {
    /// Path without the leading '/' → contents.
    files: BTreeMap<String, Vec<u8>>,
    /// Every parent directory of a file, with a trailing '/'.
    dirs: BTreeSet<String>,
}

fn tree(spec: &Spec) -> Result<Tree> {
    let mut entries = BTreeMap::new();
    for (src, dst) in &spec.files {
        ensure!(dst.starts_with('/') && !dst.ends_with('/') && !dst.contains(".."), "image path {dst:?}: must be absolute, a file and without '..'");
        let rel = dst.trim_start_matches('/').to_owned();
        let body = fs::read(src).with_context(|| format!("reading {} for {dst}", src.display()))?;
        if let Some(old) = entries.insert(rel, body) {
            ensure!(old == fs::read(src)?, "{dst} given twice with different contents");
        }
    }
    let mut dirs = BTreeSet::new();
    for rel in entries.keys() {
        let mut p = Path::new(rel).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(format!("{}/", d.display()));
            p = d.parent();
        }
    }
    Ok(Tree { files: entries, dirs })
}

/// The image's only layer, uncompressed: every parent directory once, then the files,
/// in path order so that the bytes depend on nothing but the inputs.
fn layer(spec: &Spec) -> Result<Vec<u8>> {
    let Tree { files, dirs } = tree(spec)?;
    let mut tar = tar::Builder::new(Vec::new());
    for d in &dirs {
        let mut h = header(tar::EntryType::Directory, 0, MODE, spec.mtime);
        tar.append_data(&mut h, d, std::io::empty())?;
    }
    for (rel, body) in &files {
        let mut h = header(tar::EntryType::Regular, body.len() as u64, MODE, spec.mtime);
        tar.append_data(&mut h, rel, body.as_slice())?;
    }
    Ok(tar.into_inner()?)
}

/// The layer's tree as a directory (replacing `dir`), with the layer's modes and
/// mtimes: the build context of `deploy/Containerfile`, whose `COPY . /` makes the
/// same layer with podman, buildah or docker.
pub fn write_rootfs(spec: &Spec, dir: &Path) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let Tree { files, dirs } = tree(spec)?;
    let name = dir.file_name().with_context(|| format!("{}: no directory name", dir.display()))?;
    let tmp = dir.with_file_name(format!("{}.tmp", name.to_string_lossy()));
    let mtime = std::time::UNIX_EPOCH + std::time::Duration::from_secs(spec.mtime.max(0) as u64);
    let _ = fs::remove_dir_all(&tmp);
    let finish = |path: &Path, file: fs::File| -> Result<()> {
        file.set_permissions(fs::Permissions::from_mode(MODE)).with_context(|| format!("chmod {}", path.display()))?;
        file.set_modified(mtime).with_context(|| format!("setting the mtime of {}", path.display()))
    };
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    for d in &dirs {
        fs::create_dir_all(tmp.join(d)).with_context(|| format!("creating {}", tmp.join(d).display()))?;
    }
    for (rel, body) in &files {
        let path = tmp.join(rel);
        fs::write(&path, body).with_context(|| format!("writing {}", path.display()))?;
        finish(&path, fs::File::open(&path)?)?;
    }
    // Directories last and deepest first: writing into one changes its mtime.
    for d in dirs.iter().rev().map(|d| tmp.join(d)).chain([tmp.clone()]) {
        finish(&d, fs::File::open(&d).with_context(|| format!("opening {}", d.display()))?)?;
    }
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing the old {}", dir.display()))?;
    }
    fs::rename(&tmp, dir).with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))
}

fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

/// Canonical JSON bytes: serde_json's default map keeps keys sorted.
fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("JSON values serialize")
}

/// Writes `spec` as an OCI image layout tar at `path` (via a temporary file, so a
/// reader never sees half an archive).
pub fn write_archive(spec: &Spec, path: &Path) -> Result<Written> {
    let layer_tar = layer(spec)?;
    let mut gz = flate2::GzBuilder::new().mtime(0).write(Vec::new(), flate2::Compression::best());
    gz.write_all(&layer_tar)?;
    let layer_gz = gz.finish()?;
    let created = &spec.created;
    let labels: Value = spec.annotations.iter().map(|(k, v)| (k.clone(), Value::from(v.as_str()))).collect::<serde_json::Map<_, _>>().into();
    let mut config = json!({
        "Entrypoint": spec.entrypoint,
        "Env": ["PATH=/usr/local/bin:/usr/bin:/bin"],
        "Labels": labels,
        "WorkingDir": "/",
    });
    if !spec.cmd.is_empty() {
        config["Cmd"] = json!(spec.cmd);
    }
    let config = to_bytes(&json!({
        "architecture": architecture(),
        "os": "linux",
        "created": created,
        "config": config,
        "rootfs": { "type": "layers", "diff_ids": [sha256(&layer_tar)] },
        "history": [{ "created": created, "created_by": "cargo xtask image" }],
    }));
    let manifest = to_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": MT_MANIFEST,
        "config": { "mediaType": MT_CONFIG, "digest": sha256(&config), "size": config.len() },
        "layers": [{ "mediaType": MT_LAYER, "digest": sha256(&layer_gz), "size": layer_gz.len() }],
        "annotations": labels,
    }));
    let reference = format!("{}:{}", spec.name, spec.tag);
    let digest = sha256(&manifest);
    let index = to_bytes(&json!({
        "schemaVersion": 2,
        "mediaType": MT_INDEX,
        "manifests": [{
            "mediaType": MT_MANIFEST,
            "digest": digest,
            "size": manifest.len(),
            "platform": { "architecture": architecture(), "os": "linux" },
            // The tag for OCI tools (skopeo `oci-archive:FILE:TAG`), the full
            // reference for `ctr images import`, which then needs no --base-name.
            "annotations": {
                "org.opencontainers.image.ref.name": spec.tag,
                "io.containerd.image.name": reference,
            },
        }],
    }));

    let mut out = tar::Builder::new(Vec::new());
    // Names ending in '/' are directories.
    let mut add = |name: &str, body: &[u8]| -> Result<()> {
        let (kind, mode) = if name.ends_with('/') { (tar::EntryType::Directory, 0o755) } else { (tar::EntryType::Regular, 0o644) };
        let mut h = header(kind, body.len() as u64, mode, spec.mtime);
        Ok(out.append_data(&mut h, name, body)?)
    };
    add("oci-layout", br#"{"imageLayoutVersion":"1.0.0"}"#)?;
    add("index.json", &index)?;
    add("blobs/", &[])?;
    add("blobs/sha256/", &[])?;
    for blob in [&config, &manifest, &layer_gz] {
        add(&format!("blobs/sha256/{}", &sha256(blob)["sha256:".len()..]), blob)?;
    }
    let bytes = out.into_inner()?;
    let tmp = path.with_extension("tar.tmp");
    fs::write(&tmp, &bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))?;
    Ok(Written { path: path.to_owned(), reference, digest, size: bytes.len() as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_dropped() {
        assert_eq!(without_credentials("https://u:tok@example.org/x.git"), "https://example.org/x.git");
        assert_eq!(without_credentials("git@example.org:x.git"), "git@example.org:x.git");
    }

    #[test]
    fn shell_words() {
        assert_eq!(shell_quote("https://example.org/x.git"), "https://example.org/x.git");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("a b'c"), r"'a b'\''c'");
    }

    /// The rootfs holds exactly the layer's files and directories, with its modes
    /// and mtimes, whatever the directory held before.
    #[test]
    fn rootfs_is_the_layer() {
        use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
        let base = std::env::temp_dir().join(format!("xtask-rootfs-{}", std::process::id()));
        let _ = fs::remove_dir_all(&base);
        fs::create_dir_all(&base).unwrap();
        let (a, b) = (base.join("a"), base.join("b"));
        fs::write(&a, b"first").unwrap();
        fs::write(&b, b"second").unwrap();
        let spec = Spec {
            name: "localhost/t".into(),
            tag: "1".into(),
            files: vec![(a, "/usr/local/bin/a".into()), (b, "/lib/b.so".into())],
            entrypoint: vec![],
            cmd: vec![],
            annotations: BTreeMap::new(),
            created: EPOCH.into(),
            mtime: 1_700_000_000,
        };
        let dir = base.join("root");
        fs::create_dir_all(dir.join("stale")).unwrap();
        write_rootfs(&spec, &dir).unwrap();
        let mut found = BTreeMap::new();
        let mut todo = vec![dir.clone()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                let m = fs::symlink_metadata(&p).unwrap();
                assert_eq!((m.permissions().mode() & 0o7777, m.mtime()), (MODE, spec.mtime), "{}", p.display());
                let rel = p.strip_prefix(&dir).unwrap().display().to_string();
                if m.is_dir() {
                    todo.push(p);
                    found.insert(rel + "/", None);
                } else {
                    found.insert(rel, Some(fs::read(&p).unwrap()));
                }
            }
        }
        let Tree { files, dirs } = tree(&spec).unwrap();
        let want: BTreeMap<_, _> = files.into_iter().map(|(k, v)| (k, Some(v))).chain(dirs.into_iter().map(|d| (d, None))).collect();
        assert_eq!(found, want);
        assert_eq!(fs::metadata(&dir).unwrap().mtime(), spec.mtime);
        fs::remove_dir_all(&base).unwrap();
    }
}
