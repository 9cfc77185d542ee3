//! Authenticated heartbeats: every datagram carries an HMAC-SHA256 tag (ring's
//! `hmac`, the primitive behind rustls) under a cluster key that every agent
//! reads from a key file or, in Kubernetes, from the `vip-heartbeat` Secret
//! (`k8s::heartbeat_key`).
//!
//! Wire: `b"VIPH"`, a one-byte version (2), the 8-byte id of the key that signed
//! it (the first 8 bytes of SHA-256 of the key), the 32-byte tag over everything
//! after it, then the heartbeat's JSON. The key file holds one key per line
//! (base64 or any text of at least 32 bytes): the first signs, every line is
//! accepted. Rotation without downtime: add the new key as a second line on every
//! node, then make it the first, then remove the old one.
use std::{fmt, path::Path};

use anyhow::{bail, Context as _, Result};
use ring::{digest, hmac};

const MAGIC: &[u8; 4] = b"VIPH";
const VERSION: u8 = 2;
const ID_LEN: usize = 8;
const TAG_LEN: usize = 32;
const HEADER: usize = MAGIC.len() + 1 + ID_LEN + TAG_LEN;
/// Keys shorter than this are refused: HMAC-SHA256 wants a key as long as its output.
pub const MIN_KEY_LEN: usize = 32;

struct Key {
    id: [u8; ID_LEN],
    key: hmac::Key,
}

/// The keys an agent signs and checks heartbeats with.
pub struct Keys {
    /// The first signs; all verify.
    keys: Vec<Key>,
}

impl fmt::Debug for Keys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<String> = self.keys.iter().map(|k| k.id.iter().map(|b| format!("{b:02x}")).collect()).collect();
        f.debug_struct("Keys").field("ids", &ids).finish()
    }
}

/// Why a datagram was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reject {
    /// Not a signed heartbeat of this version.
    Malformed,
    /// Signed with a key this agent does not have.
    UnknownKey,
    /// The tag does not match: forged or altered.
    BadTag,
}

impl Keys {
    /// Keys from their bytes (one per entry, the first signs).
    pub fn new(secrets: &[Vec<u8>]) -> Result<Self> {
        if secrets.is_empty() {
            bail!("no heartbeat key");
        }
        let mut keys = Vec::new();
        for (i, s) in secrets.iter().enumerate() {
            if s.len() < MIN_KEY_LEN {
                bail!("heartbeat key {} is {} bytes; at least {MIN_KEY_LEN} are needed", i + 1, s.len());
            }
            let d = digest::digest(&digest::SHA256, s);
            let mut id = [0u8; ID_LEN];
            id.copy_from_slice(&d.as_ref()[..ID_LEN]);
            keys.push(Key { id, key: hmac::Key::new(hmac::HMAC_SHA256, s) });
        }
        Ok(Self { keys })
    }

    /// Parses a key text (a key file, the Secret's `key`): one key per non-empty
    /// line, `#` comments skipped.
    pub fn from_text(text: &str) -> Result<Self> {
        let lines: Vec<Vec<u8>> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(|l| l.as_bytes().to_vec()).collect();
        Self::new(&lines)
    }

    /// Reads a key file (see [`Keys::from_text`]).
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the heartbeat key file {}", path.display()))?;
        Self::from_text(&text).with_context(|| format!("heartbeat key file {}", path.display()))
    }

    /// `payload`, signed with the first key.
    pub fn seal(&self, payload: &[u8]) -> Vec<u8> {
        let k = &self.keys[0];
        let mut out = Vec::with_capacity(HEADER + payload.len());
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        out.extend_from_slice(&k.id);
        out.extend_from_slice(&[0u8; TAG_LEN]);
        out.extend_from_slice(payload);
        let tag = hmac::sign(&k.key, &signed_part(&out));
        out[MAGIC.len() + 1 + ID_LEN..HEADER].copy_from_slice(tag.as_ref());
        out
    }

    /// The payload of a datagram signed with one of our keys.
    pub fn open<'a>(&self, datagram: &'a [u8]) -> Result<&'a [u8], Reject> {
        if datagram.len() < HEADER || &datagram[..MAGIC.len()] != MAGIC || datagram[MAGIC.len()] != VERSION {
            return Err(Reject::Malformed);
        }
        let id = &datagram[MAGIC.len() + 1..MAGIC.len() + 1 + ID_LEN];
        let tag = &datagram[MAGIC.len() + 1 + ID_LEN..HEADER];
        let k = self.keys.iter().find(|k| k.id == id).ok_or(Reject::UnknownKey)?;
        hmac::verify(&k.key, &signed_part(datagram), tag).map_err(|_| Reject::BadTag)?;
        Ok(&datagram[HEADER..])
    }
}

/// What the tag covers: the version and key id, then the payload (the tag's own
/// bytes are left out).
fn signed_part(datagram: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(datagram.len() - TAG_LEN);
    v.extend_from_slice(&datagram[..MAGIC.len() + 1 + ID_LEN]);
    v.extend_from_slice(&datagram[HEADER..]);
    v
}

/// Keys shared with the heartbeat task and swapped in place when the key file
/// changes (a rotation step), without restarting anything.
pub type SharedKeys = std::sync::Arc<std::sync::RwLock<std::sync::Arc<Keys>>>;

/// Keys taken from a key text (the key file, the Secret) and the text they came from.
pub struct KeyText {
    text: String,
    pub keys: SharedKeys,
}

impl KeyText {
    pub fn new(text: String) -> Result<Self> {
        let keys = Keys::from_text(&text)?;
        Ok(Self { text, keys: std::sync::Arc::new(std::sync::RwLock::new(std::sync::Arc::new(keys))) })
    }

    /// Takes `text` when it differs from the last; true when new keys were taken.
    /// Invalid text keeps the last good keys (and says why).
    pub fn update(&mut self, text: String) -> Result<bool> {
        if text == self.text {
            return Ok(false);
        }
        let keys = Keys::from_text(&text)?;
        self.text = text;
        *self.keys.write().unwrap_or_else(|e| e.into_inner()) = std::sync::Arc::new(keys);
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(c: u8) -> Vec<u8> {
        vec![c; 32]
    }

    #[test]
    fn sealed_opens_and_anything_else_is_refused() {
        let k = Keys::new(&[key(b'a')]).unwrap();
        let d = k.seal(b"{\"v\":1}");
        assert_eq!(k.open(&d), Ok(&b"{\"v\":1}"[..]));
        // A flipped payload byte, a flipped tag byte.
        let mut bad = d.clone();
        *bad.last_mut().unwrap() ^= 1;
        assert_eq!(k.open(&bad), Err(Reject::BadTag));
        let mut bad = d.clone();
        bad[HEADER - 1] ^= 1;
        assert_eq!(k.open(&bad), Err(Reject::BadTag));
        // Another key, unsigned JSON, truncation.
        let other = Keys::new(&[key(b'b')]).unwrap();
        assert_eq!(k.open(&other.seal(b"x")), Err(Reject::UnknownKey));
        assert_eq!(k.open(b"{\"v\":1,\"node\":\"n\"}"), Err(Reject::Malformed));
        assert_eq!(k.open(&d[..HEADER - 1]), Err(Reject::Malformed));
        // A forger who rewrites the key id to ours still lacks the key.
        let mut forged = other.seal(b"x");
        forged[5..13].copy_from_slice(&d[5..13]);
        assert_eq!(k.open(&forged), Err(Reject::BadTag));
    }

    #[test]
    fn rotation_accepts_both_keys_and_signs_with_the_first() {
        let old = Keys::new(&[key(b'a')]).unwrap();
        let both = Keys::new(&[key(b'a'), key(b'b')]).unwrap();
        let new_first = Keys::new(&[key(b'b'), key(b'a')]).unwrap();
        let new = Keys::new(&[key(b'b')]).unwrap();
        // Step 1: every node has both, the old signs: old-only nodes still accept.
        assert!(old.open(&both.seal(b"x")).is_ok());
        // Step 2: the new key signs; nodes still at step 1 accept it.
        assert!(both.open(&new_first.seal(b"x")).is_ok());
        // Step 3: the old key is gone.
        assert!(new.open(&new_first.seal(b"x")).is_ok());
        assert_eq!(new.open(&old.seal(b"x")), Err(Reject::UnknownKey));
    }

    #[test]
    fn short_keys_and_empty_files_are_refused() {
        assert!(Keys::new(&[b"short".to_vec()]).unwrap_err().to_string().contains("at least 32"));
        assert!(Keys::new(&[]).is_err());
    }
}
