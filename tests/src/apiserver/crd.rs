//! Custom resources checked against their CRD's structural schema, as the real
//! server's apiextensions-apiserver does on every write (checked against
//! kube-apiserver v1.36 in `tests/tests/k8s_strict.rs`):
//! - null values of non-nullable properties are dropped, then unknown fields are
//!   pruned (each named in a `Warning: 299 - "unknown field \"spec.foo\""` header),
//!   then `default`s fill what is missing;
//! - then validation: `type` (`integer` takes whole numbers only; `nullable`),
//!   `required`, `enum`, `minimum`/`maximum` (and their exclusive forms),
//!   `minLength`/`maxLength`, `pattern`, `minItems`/`maxItems`, the `format`s listed
//!   in [`check_format`] (int32/int64 ranges too) and `x-kubernetes-int-or-string`;
//!   every failure is a cause of one 422 Invalid, with the real server's reason,
//!   field path and wording. `x-kubernetes-preserve-unknown-fields` turns pruning
//!   off below it.
//!
//! A schema keyword this file does not enforce (CEL rules in
//! `x-kubernetes-validations`, list types other than atomic, ...), or a `pattern`
//! Rust's `regex` may read otherwise than Go's `regexp` ([`go_regexp_differs`]),
//! makes loading the schema panic, so that a CRD change the stand-in cannot follow
//! shows at once rather than leaving it laxer than the real server.
//!
//! Written here rather than with a JSON Schema crate such as `jsonschema`: an
//! OpenAPI v3 structural schema is not JSON Schema (`nullable`, the `x-kubernetes-*`
//! extensions, pruning and defaulting are not in any draft), and the point is the
//! real server's causes (reason, field path, message) which a generic validator's
//! errors would have to be mapped back to one by one; the walk that prunes and
//! defaults has to be written anyway, and validating in it is a few lines more.
use serde_json::Value;

use super::Cause;

/// The CRDs of deploy/ (only `crd.yaml` defines any), compiled in.
const CRDS: &str = include_str!("../../../deploy/crd.yaml");

/// Keywords of a schema node that carry no check (documentation, or what the real
/// server applies elsewhere: `default` is handled by [`prepare`] itself).
const INERT: &[&str] = &["description", "title", "example", "externalDocs", "default", "x-kubernetes-map-type"];
/// Formats the real server checks that [`check_format`] does not.
const UNCHECKED_FORMATS: &[&str] = &[
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "mac",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
    "duration",
];
/// Keywords [`validate`] enforces.
const ENFORCED: &[&str] = &[
    "type",
    "nullable",
    "properties",
    "additionalProperties",
    "items",
    "required",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-int-or-string",
];

/// The `openAPIV3Schema` of one served version of a custom resource.
#[derive(Clone, Debug)]
pub(crate) struct Schema(Value);

impl Schema {
    /// The schema of `group`/`version`/`plural` in deploy/crd.yaml, if a CRD there defines it.
    pub(crate) fn find(group: &str, version: &str, plural: &str) -> Option<Self> {
        use serde::Deserialize as _;
        for doc in serde_yaml_ng::Deserializer::from_str(CRDS) {
            let crd = Value::deserialize(doc).expect("deploy/crd.yaml is YAML");
            if crd["kind"] != "CustomResourceDefinition" || crd["spec"]["group"] != group || crd["spec"]["names"]["plural"] != plural {
                continue;
            }
            let v = crd["spec"]["versions"].as_array()?.iter().find(|v| v["name"] == version)?;
            let schema = v["schema"]["openAPIV3Schema"].clone();
            check_supported(&schema, "");
            return Some(Schema(schema));
        }
        None
    }
}

/// Panics on a keyword the stand-in does not enforce (see the module comment).
fn check_supported(s: &Value, at: &str) {
    let Some(m) = s.as_object() else { return };
    for (k, v) in m {
        let here = format!("{at}/{k}");
        match k.as_str() {
            "properties" => v.as_object().into_iter().flatten().for_each(|(p, ps)| check_supported(ps, &format!("{here}/{p}"))),
            "items" | "additionalProperties" => check_supported(v, &here),
            // The default list type: nothing to check.
            "x-kubernetes-list-type" if v == "atomic" => {}
            "format" if v.as_str().is_some_and(|f| UNCHECKED_FORMATS.contains(&f)) => {
                panic!("the API stand-in does not check format {v} (`{here}` of deploy/crd.yaml): teach check_format in tests/src/apiserver/crd.rs")
            }
            "pattern" => {
                let p = v.as_str().unwrap_or_else(|| panic!("`{here}` of deploy/crd.yaml is not a string"));
                if let Err(e) = regex::Regex::new(p) {
                    panic!("`{here}` of deploy/crd.yaml ({p}) does not compile: {e}");
                }
                if let Some(why) = go_regexp_differs(p) {
                    panic!("the API stand-in cannot match `{here}` of deploy/crd.yaml ({p}) as the real server does: {why}");
                }
            }
            k if INERT.contains(&k) || ENFORCED.contains(&k) => {}
            _ => panic!("the API stand-in does not enforce `{here}` of deploy/crd.yaml: teach tests/src/apiserver/crd.rs (see the real server's behaviour in k8s_strict.rs)"),
        }
    }
}

/// Why Rust's `regex` might match `pattern` otherwise than Go's `regexp`, which the
/// real server uses (both take RE2 syntax), if it might: Perl classes are ASCII in
/// Go and Unicode in Rust; nested classes and class set operations (`&&`, `--`,
/// `~~`) are Rust's, literal characters in Go.
fn go_regexp_differs(pattern: &str) -> Option<&'static str> {
    let mut chars = pattern.chars().peekable();
    let mut in_class = false;
    let mut prev = None;
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some('d' | 'D' | 's' | 'S' | 'w' | 'W' | 'b' | 'B') = chars.next() {
                    return Some("\\d, \\s, \\w and \\b are ASCII in Go, Unicode in Rust: write [0-9], [[:space:]], [0-9A-Za-z_]");
                }
                prev = None;
                continue;
            }
            '[' if !in_class => {
                in_class = true;
                // A `]` first in the class (after `^`) is literal in both.
                chars.next_if_eq(&'^');
                chars.next_if_eq(&']');
            }
            '[' if chars.peek() == Some(&':') => {
                // A POSIX class (`[:space:]`, ASCII in both) up to its `:]`.
                while chars.next().is_some_and(|c| c != ']') {}
            }
            '[' => return Some("a class nested in a class is Rust's only (Go reads the `[` literally)"),
            ']' if in_class => in_class = false,
            '&' | '-' | '~' if in_class && prev == Some(c) => return Some("class set operations (&&, --, ~~) are Rust's only"),
            _ => {}
        }
        prev = Some(c);
    }
    None
}

/// Which part of the object a write sets, as far as validation goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scope {
    /// The whole object (create, update of the main resource, the in-process hook).
    Object,
    /// `.status` only (the status subresource): it alone is pruned, defaulted and
    /// validated, and the real server words its messages from `status` down
    /// (`allocated in body ...`) while the field paths still start at the root.
    Status,
}

/// Prunes, defaults and validates `obj` in place; the warnings for pruned fields,
/// or the causes of a 422.
pub(crate) fn prepare(schema: &Schema, obj: &mut Value, scope: Scope) -> Result<Vec<String>, Vec<Cause>> {
    let mut warnings = Vec::new();
    let mut causes = Vec::new();
    match scope {
        Scope::Object => {
            let root = obj.as_object_mut().expect("the store checked it is an object");
            // apiVersion, kind and metadata are the server's, not the schema's.
            let kept: Vec<(String, Value)> = ["apiVersion", "kind", "metadata"].iter().filter_map(|k| root.remove(*k).map(|v| (k.to_string(), v))).collect();
            shape(&schema.0, obj, &Path::root(), &mut warnings);
            validate(&schema.0, obj, &Path::root(), &mut causes);
            let root = obj.as_object_mut().expect("still an object");
            root.extend(kept);
        }
        Scope::Status => {
            let st = &schema.0["properties"]["status"];
            let path = Path { field: "status".into(), message: String::new() };
            match obj.get_mut("status") {
                Some(v) if v.is_null() && !nullable(st) => {
                    obj.as_object_mut().expect("object").remove("status");
                }
                Some(v) => {
                    shape(st, v, &path, &mut warnings);
                    validate(st, v, &path, &mut causes);
                }
                None => {}
            }
        }
    }
    if causes.is_empty() {
        Ok(warnings)
    } else {
        Err(causes)
    }
}

/// Where a value is: its field path (`status.conditions[0].type`) and the path the
/// real server's messages use (`conditions[0].type` under a status write).
#[derive(Clone, Debug)]
struct Path {
    field: String,
    message: String,
}

impl Path {
    fn root() -> Self {
        Path { field: String::new(), message: String::new() }
    }
    fn join(a: &str, b: &str, sep: &str) -> String {
        if a.is_empty() {
            b.to_owned()
        } else {
            format!("{a}{sep}{b}")
        }
    }
    fn child(&self, name: &str) -> Self {
        Path { field: Self::join(&self.field, name, "."), message: Self::join(&self.message, name, ".") }
    }
    fn index(&self, i: usize) -> Self {
        Path { field: format!("{}[{i}]", self.field), message: format!("{}[{i}]", self.message) }
    }
}

fn nullable(s: &Value) -> bool {
    s["nullable"] == true
}

fn preserves_unknown(s: &Value) -> bool {
    s["x-kubernetes-preserve-unknown-fields"] == true
}

/// Null-dropping, pruning and defaulting, top-down, as the real server decodes a body.
fn shape(s: &Value, v: &mut Value, at: &Path, warnings: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            let props = s["properties"].as_object();
            let additional = s.get("additionalProperties").filter(|a| a.is_object());
            if props.is_none() && additional.is_none() {
                if !preserves_unknown(s) && s.get("type").is_some_and(|t| t == "object") {
                    // An object with neither: the real server keeps nothing of it.
                    for k in m.keys() {
                        warnings.push(format!("unknown field \"{}\"", at.child(k).field));
                    }
                    m.clear();
                }
                return;
            }
            let schema_of = |k: &str| props.and_then(|p| p.get(k)).or(additional);
            m.retain(|k, val| match schema_of(k) {
                // A null where null is not allowed is dropped (and defaulted below).
                Some(ps) => !val.is_null() || nullable(ps),
                None if preserves_unknown(s) => true,
                None => {
                    warnings.push(format!("unknown field \"{}\"", at.child(k).field));
                    false
                }
            });
            for (k, ps) in props.into_iter().flatten() {
                if let (false, Some(d)) = (m.contains_key(k), ps.get("default")) {
                    m.insert(k.clone(), d.clone());
                }
            }
            for (k, val) in m.iter_mut() {
                if let Some(ps) = schema_of(k) {
                    shape(ps, val, &at.child(k), warnings);
                }
            }
        }
        Value::Array(items) => {
            if let Some(is) = s.get("items") {
                for (i, it) in items.iter_mut().enumerate() {
                    shape(is, it, &at.index(i), warnings);
                }
            }
        }
        _ => {}
    }
}

/// A number the real server's decoder takes as an integer: one that fits an int64,
/// or a whole float within +-2^53 (`3.0`).
fn json_integer(v: &Value) -> bool {
    v.is_i64() || v.as_f64().is_some_and(|f| f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0)
}

/// What the real server calls the JSON type of a value in its messages.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() => "integer",
        Value::Number(_) => "float64",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// How the real server prints a bound from the schema (`0.0` in YAML prints as `0`).
fn num(v: &Value) -> String {
    match v.as_f64() {
        Some(f) if f.fract() == 0.0 && f.abs() < 1e15 => format!("{}", f as i64),
        _ => v.to_string(),
    }
}

fn validate(s: &Value, v: &Value, at: &Path, causes: &mut Vec<Cause>) {
    let cause = |reason: &'static str, message: String| Cause { reason, message, field: at.field.clone() };
    let in_body = |what: String| format!("{} in body {what}", at.message);
    // The int32/int64 format check's cause, which names no field.
    let format_cause = |format: &str| {
        let which = if format.is_empty() { "(default format)".to_owned() } else { format!("with format {format}") };
        Cause::invalid("<nil>", &format!("Invalid value: \"\": Checked value must be of type integer {which} in {}", at.message))
    };
    if v.is_null() && nullable(s) {
        return;
    }
    let ty = s["type"].as_str().unwrap_or("");
    let int_or_string = s["x-kubernetes-int-or-string"] == true;
    let format = s["format"].as_str().unwrap_or("");
    let type_ok = match (ty, v) {
        _ if int_or_string => v.is_string() || json_integer(v),
        ("", _) => true,
        ("object", Value::Object(_)) | ("array", Value::Array(_)) | ("string", Value::String(_)) | ("boolean", Value::Bool(_)) => true,
        ("number", Value::Number(_)) => true,
        ("integer", n @ Value::Number(_)) => json_integer(n),
        _ => false,
    };
    if let Some(e) = s["enum"].as_array().filter(|e| !e.contains(v)) {
        // Checked whatever the value's type, as the real server does.
        causes.push(cause("FieldValueNotSupported", unsupported(v, e)));
    }
    if !type_ok {
        // A fraction where an int32/int64 is wanted is a "float64" of the wrong
        // format; elsewhere it is a "number". Where an integer is wanted, the
        // format check adds a cause without a field (as the real server does).
        let sized = matches!(format, "int32" | "int64");
        let fraction = ty == "integer" && v.is_number();
        let got = match type_name(v) {
            "float64" if !(fraction && sized) => "number",
            t => t,
        };
        let want = match () {
            _ if int_or_string => "integer,string",
            _ if fraction && sized => format,
            _ => ty,
        };
        causes.push(cause("FieldValueTypeInvalid", format!("Invalid value: \"{got}\": {}", in_body(format!("must be of type {want}: \"{got}\"")))));
        if fraction {
            causes.push(format_cause(if sized { format } else { "" }));
        }
        return;
    }
    if let (Some(x), true) = (v.as_f64(), v.is_number()) {
        let bound = |key: &str| s.get(key).and_then(Value::as_f64).map(|b| (b, num(&s[key])));
        let exclusive = |key: &str| s[key] == true;
        if let Some((min, shown)) = bound("minimum") {
            if x < min || (exclusive("exclusiveMinimum") && x == min) {
                let rel = if exclusive("exclusiveMinimum") { "greater than" } else { "greater than or equal to" };
                causes.push(cause("FieldValueInvalid", format!("Invalid value: {v}: {}", in_body(format!("should be {rel} {shown}")))));
            }
        }
        if let Some((max, shown)) = bound("maximum") {
            if x > max || (exclusive("exclusiveMaximum") && x == max) {
                let rel = if exclusive("exclusiveMaximum") { "less than" } else { "less than or equal to" };
                causes.push(cause("FieldValueInvalid", format!("Invalid value: {v}: {}", in_body(format!("should be {rel} {shown}")))));
            }
        }
        let range = match format {
            "int32" => Some((i32::MIN as f64, i32::MAX as f64)),
            "int64" => Some((i64::MIN as f64, i64::MAX as f64)),
            _ => None,
        };
        if range.is_some_and(|(lo, hi)| x < lo || x > hi) {
            causes.push(format_cause(format));
        }
    }
    match v {
        Value::String(st) => {
            let q = go_quote(st);
            let len = st.chars().count() as u64;
            let pattern = s["pattern"].as_str();
            // At most one of these, the first that fails: the real server's string
            // validator stops there (the format is checked on its own).
            if let Some(max) = s["maxLength"].as_u64().filter(|m| len > *m) {
                causes.push(cause("FieldValueTooLong", format!("Too long: may not be more than {max} bytes")));
            } else if let Some(min) = s["minLength"].as_u64().filter(|m| len < *m) {
                causes.push(cause("FieldValueInvalid", format!("Invalid value: {q}: {}", in_body(format!("should be at least {min} chars long")))));
            } else if let Some(p) = pattern.filter(|p| !regex::Regex::new(p).expect("checked when the schema loaded").is_match(st)) {
                causes.push(cause("FieldValueInvalid", format!("Invalid value: {q}: {}", in_body(format!("should match '{p}'")))));
            }
            if !int_or_string && !check_format(format, st) {
                causes.push(cause("FieldValueTypeInvalid", format!("Invalid value: {q}: {}", in_body(format!("must be of type {format}: {q}")))));
            }
        }
        Value::Array(items) => {
            let n = items.len() as u64;
            if let Some(max) = s["maxItems"].as_u64().filter(|m| n > *m) {
                causes.push(cause("FieldValueTooMany", format!("Too many: {n}: must have at most {max} items")));
            }
            if let Some(min) = s["minItems"].as_u64().filter(|m| n < *m) {
                causes.push(cause("FieldValueInvalid", format!("Invalid value: {n}: {}", in_body(format!("should have at least {min} items")))));
            }
            if let Some(is) = s.get("items") {
                for (i, it) in items.iter().enumerate() {
                    validate(is, it, &at.index(i), causes);
                }
            }
        }
        Value::Object(m) => {
            for r in s["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                if !m.contains_key(r) {
                    causes.push(Cause { reason: "FieldValueRequired", message: "Required value".into(), field: at.child(r).field });
                }
            }
            let props = s["properties"].as_object();
            let additional = s.get("additionalProperties").filter(|a| a.is_object());
            for (k, val) in m {
                if let Some(ps) = props.and_then(|p| p.get(k)).or(additional) {
                    validate(ps, val, &at.child(k), causes);
                }
            }
        }
        _ => {}
    }
}

fn unsupported(v: &Value, allowed: &[Value]) -> String {
    let list: Vec<String> = allowed.iter().map(shown).collect();
    format!("Unsupported value: {}: supported values: {}", shown(v), list.join(", "))
}

/// A value in a message: strings as Go's `%q` writes them, the rest as JSON.
fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => go_quote(s),
        v => v.to_string(),
    }
}

/// Go's `strconv.Quote`, which the real server's messages use for strings (JSON
/// escapes differ: `\v` there is `\u000b` in JSON). Printable characters are kept;
/// Go's `unicode.IsPrint` is approximated by "not a control character and not a
/// space other than ' '" (format and unassigned characters, which Go escapes, are
/// kept here).
fn go_quote(s: &str) -> String {
    let mut out = String::from('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                out.push('\\');
                out.push(c);
            }
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if c.is_control() || (c.is_whitespace() && c != ' ') => match c as u32 {
                n if n < 0x10000 => out.push_str(&format!("\\u{n:04x}")),
                n => out.push_str(&format!("\\U{n:08x}")),
            },
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The string formats of the real server's list (apiextensions-apiserver's
/// supported formats) that this file checks; every other format name passes, as
/// an unknown one does on the real server (which warns about it when the CRD is
/// created). The numeric formats (int32, int64) are checked on numbers above.
fn check_format(format: &str, s: &str) -> bool {
    match format {
        "date-time" | "datetime" => date_time(s),
        "date" => date(s).is_some(),
        "ipv4" => s.parse::<std::net::Ipv4Addr>().is_ok(),
        "ipv6" => s.parse::<std::net::Ipv6Addr>().is_ok(),
        "cidr" => s.split_once('/').is_some_and(|(a, p)| {
            let bits = if a.parse::<std::net::Ipv4Addr>().is_ok() {
                32
            } else if a.parse::<std::net::Ipv6Addr>().is_ok() {
                128
            } else {
                return false;
            };
            p.parse::<u8>().is_ok_and(|p| p <= bits)
        }),
        "uuid" => {
            let parts: Vec<&str> = s.split('-').collect();
            parts.iter().map(|p| p.len()).eq([8, 4, 4, 4, 12]) && parts.iter().all(|p| p.chars().all(|c| c.is_ascii_hexdigit()))
        }
        "password" => true,
        "byte" => {
            use base64::Engine as _;
            base64::engine::general_purpose::STANDARD.decode(s).is_ok()
        }
        _ => true,
    }
}

/// `YYYY-MM-DD`, checked as a calendar date.
fn date(s: &str) -> Option<()> {
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s.get(r)?.parse::<u32>().ok();
    let (y, m, d) = (n(0..4)?, n(5..7)?, n(8..10)?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days = [31, if leap { 29 } else { 28 }, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31];
    ((1..=12).contains(&m) && d >= 1 && d <= days[m as usize - 1]).then_some(())
}

/// RFC 3339 as the real server's format checker takes it: `T` (or `t`), seconds,
/// optional fraction, a zone (`Z`, `z` or `+hh:mm`); anything else (no zone, a
/// space, `+hhmm`, second 60) is refused.
fn date_time(s: &str) -> bool {
    let (Some(d), Some(sep), Some(rest)) = (s.get(..10), s.get(10..11), s.get(11..)) else { return false };
    if date(d).is_none() || !matches!(sep, "T" | "t") {
        return false;
    }
    let two = |f: &str, max: u32| f.len() == 2 && f.bytes().all(|b| b.is_ascii_digit()) && f.parse::<u32>().is_ok_and(|v| v <= max);
    let (Some(h), Some(m), Some(sec)) = (rest.get(0..2), rest.get(3..5), rest.get(6..8)) else { return false };
    if !(two(h, 23) && two(m, 59) && two(sec, 59) && &rest[2..3] == ":" && &rest[5..6] == ":") {
        return false;
    }
    let mut tail = &rest[8..];
    if let Some(frac) = tail.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return false;
        }
        tail = &frac[digits..];
    }
    match tail {
        "Z" | "z" => true,
        z => z.len() == 6 && matches!(&z[..1], "+" | "-") && two(&z[1..3], 23) && &z[3..4] == ":" && two(&z[4..6], 59),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn apiserver_crd_date_times() {
        // What kube-apiserver v1.36.2 took and refused for a `format: date-time` string.
        for ok in
            ["2024-01-01T10:00:00.5Z", "2024-01-01t10:00:00z", "2024-01-01T10:00:00+02:00", "2024-01-01T10:00:00.1234567891Z", "2024-02-29T23:59:59-11:30"]
        {
            assert!(date_time(ok), "{ok}");
        }
        let bad = [
            "2024-01-01T10:00:00",
            "2024-01-01T10:00Z",
            "2024-01-01T10:00",
            "2024-01-01T10:00:00+0200",
            "2024-01-01T10:00:00.Z",
            "2024-01-01T24:00:00Z",
            "2024-01-01T10:00:60Z",
            "2024-01-01 10:00:00Z",
            "2024-01-01 10:00:00",
            "2024-01-01",
            "2023-02-29T00:00:00Z",
            "yesterday",
        ];
        for b in bad {
            assert!(!date_time(b), "{b}");
        }
    }

    #[test]
    fn apiserver_crd_schema_of_vippools_loads() {
        let s = Schema::find("vip.dev", "v1alpha1", "vippools").expect("the VipPool CRD");
        let mut pool = json!({ "apiVersion": "vip.dev/v1alpha1", "kind": "VipPool", "metadata": { "name": "p" }, "spec": { "addresses": [] } });
        assert_eq!(prepare(&s, &mut pool, Scope::Object), Ok(vec![]));
        assert!(Schema::find("vip.dev", "v1", "vippools").is_none());
    }

    /// A schema with what deploy/crd.yaml does not use yet, and objects with the
    /// causes kube-apiserver v1.36.2 gave for them (captured with the same schema
    /// installed as a CRD): exclusive bounds, lengths, item counts, string formats,
    /// int-or-string, preserved and pruned unknown fields, fractions in integers.
    #[test]
    fn apiserver_crd_keywords_as_the_real_server_reports_them() {
        let schema = Schema(json!({ "type": "object", "properties": { "spec": { "type": "object", "properties": {
            "s": { "type": "string", "minLength": 2, "maxLength": 3 },
            "l": { "type": "array", "minItems": 1, "maxItems": 2, "items": { "type": "string" } },
            "n": { "type": "number", "minimum": 0, "exclusiveMinimum": true, "maximum": 10, "exclusiveMaximum": true },
            "ios": { "x-kubernetes-int-or-string": true },
            "p": { "type": "object", "x-kubernetes-preserve-unknown-fields": true },
            "e": { "type": "object" },
            "i": { "type": "integer" }, "i32": { "type": "integer", "format": "int32" }, "bo": { "type": "boolean" },
            "d": { "type": "string", "format": "date" }, "ip4": { "type": "string", "format": "ipv4" }, "ip6": { "type": "string", "format": "ipv6" },
            "c": { "type": "string", "format": "cidr" }, "u": { "type": "string", "format": "uuid" }, "b": { "type": "string", "format": "byte" },
            "dt": { "type": "string", "format": "date-time" } } } } }));
        check_supported(&schema.0, "");
        let run = |spec: Value| {
            let mut obj = json!({ "metadata": { "name": "x" }, "spec": spec });
            let mut out: Vec<(String, String, String)> = match prepare(&schema, &mut obj, Scope::Object) {
                Ok(w) => w.into_iter().map(|w| ("warning".into(), String::new(), w)).collect(),
                Err(c) => c.into_iter().map(|c| (c.reason.to_owned(), c.field, c.message)).collect(),
            };
            out.sort();
            (out, obj)
        };
        let want = |v: &[(&str, &str, &str)]| {
            let mut v: Vec<(String, String, String)> = v.iter().map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string())).collect();
            v.sort();
            v
        };
        let (got, _) = run(json!({ "s": "a", "l": [], "n": 0, "ios": 1.5, "p": { "q": 1 }, "e": { "r": 1 }, "d": "2023-02-29", "ip4": "1.2.3", "ip6": "zz",
                                   "c": "10.0.0.0/33", "u": "abc", "b": "!!!", "dt": "2024-01-01" }));
        assert_eq!(
            got,
            want(&[
                ("FieldValueTypeInvalid", "spec.dt", "Invalid value: \"2024-01-01\": spec.dt in body must be of type date-time: \"2024-01-01\""),
                ("FieldValueTypeInvalid", "spec.u", "Invalid value: \"abc\": spec.u in body must be of type uuid: \"abc\""),
                ("FieldValueTypeInvalid", "spec.ip4", "Invalid value: \"1.2.3\": spec.ip4 in body must be of type ipv4: \"1.2.3\""),
                ("FieldValueInvalid", "spec.s", "Invalid value: \"a\": spec.s in body should be at least 2 chars long"),
                ("FieldValueTypeInvalid", "spec.ip6", "Invalid value: \"zz\": spec.ip6 in body must be of type ipv6: \"zz\""),
                ("FieldValueTypeInvalid", "spec.ios", "Invalid value: \"number\": spec.ios in body must be of type integer,string: \"number\""),
                ("FieldValueTypeInvalid", "spec.d", "Invalid value: \"2023-02-29\": spec.d in body must be of type date: \"2023-02-29\""),
                ("FieldValueInvalid", "spec.l", "Invalid value: 0: spec.l in body should have at least 1 items"),
                ("FieldValueTypeInvalid", "spec.c", "Invalid value: \"10.0.0.0/33\": spec.c in body must be of type cidr: \"10.0.0.0/33\""),
                ("FieldValueTypeInvalid", "spec.b", "Invalid value: \"!!!\": spec.b in body must be of type byte: \"!!!\""),
                ("FieldValueInvalid", "spec.n", "Invalid value: 0: spec.n in body should be greater than 0"),
            ])
        );
        let (got, _) = run(json!({ "s": "abcd", "l": ["a", "b", "c"], "n": 10, "ios": true }));
        assert_eq!(
            got,
            want(&[
                ("FieldValueTypeInvalid", "spec.ios", "Invalid value: \"boolean\": spec.ios in body must be of type integer,string: \"boolean\""),
                ("FieldValueTooMany", "spec.l", "Too many: 3: must have at most 2 items"),
                ("FieldValueTooLong", "spec.s", "Too long: may not be more than 3 bytes"),
                ("FieldValueInvalid", "spec.n", "Invalid value: 10: spec.n in body should be less than 10"),
            ])
        );
        let (got, _) = run(json!({ "s": 1.5, "i": 1.5, "i32": 1.5, "bo": 1.5, "l": [1.5, 2, {}], "ios": {} }));
        assert_eq!(
            got,
            want(&[
                ("FieldValueTypeInvalid", "spec.l[0]", "Invalid value: \"number\": spec.l[0] in body must be of type string: \"number\""),
                ("FieldValueTypeInvalid", "spec.l[1]", "Invalid value: \"integer\": spec.l[1] in body must be of type string: \"integer\""),
                ("FieldValueTypeInvalid", "spec.l[2]", "Invalid value: \"object\": spec.l[2] in body must be of type string: \"object\""),
                ("FieldValueTooMany", "spec.l", "Too many: 3: must have at most 2 items"),
                ("FieldValueTypeInvalid", "spec.i", "Invalid value: \"number\": spec.i in body must be of type integer: \"number\""),
                ("FieldValueInvalid", "<nil>", "Invalid value: \"\": Checked value must be of type integer (default format) in spec.i"),
                ("FieldValueTypeInvalid", "spec.bo", "Invalid value: \"number\": spec.bo in body must be of type boolean: \"number\""),
                ("FieldValueTypeInvalid", "spec.i32", "Invalid value: \"float64\": spec.i32 in body must be of type int32: \"float64\""),
                ("FieldValueInvalid", "<nil>", "Invalid value: \"\": Checked value must be of type integer with format int32 in spec.i32"),
                ("FieldValueTypeInvalid", "spec.s", "Invalid value: \"number\": spec.s in body must be of type string: \"number\""),
                ("FieldValueTypeInvalid", "spec.ios", "Invalid value: \"object\": spec.ios in body must be of type integer,string: \"object\""),
            ])
        );
        let (got, _) = run(json!({ "s": 2, "i": "x", "i32": 3000000000u64, "bo": "x", "ios": [1] }));
        assert_eq!(
            got,
            want(&[
                ("FieldValueTypeInvalid", "spec.i", "Invalid value: \"string\": spec.i in body must be of type integer: \"string\""),
                ("FieldValueTypeInvalid", "spec.bo", "Invalid value: \"string\": spec.bo in body must be of type boolean: \"string\""),
                ("FieldValueInvalid", "<nil>", "Invalid value: \"\": Checked value must be of type integer with format int32 in spec.i32"),
                ("FieldValueTypeInvalid", "spec.s", "Invalid value: \"integer\": spec.s in body must be of type string: \"integer\""),
                ("FieldValueTypeInvalid", "spec.ios", "Invalid value: \"array\": spec.ios in body must be of type integer,string: \"array\""),
            ])
        );
        // Accepted, with the pruned field warned about and the preserved one kept.
        let (got, obj) = run(json!({ "s": "ab", "l": ["a"], "n": 5, "ios": "x", "p": { "q": { "deep": 1 } }, "e": { "r": 1 }, "d": "2024-02-29",
                                     "ip4": "1.2.3.4", "ip6": "::1", "c": "10.0.0.0/8", "u": "123e4567-e89b-12d3-a456-426614174000", "b": "aGk=",
                                     "dt": "2024-01-01T10:00:00+02:00" }));
        assert_eq!(got, want(&[("warning", "", "unknown field \"spec.e.r\"")]));
        assert_eq!((&obj["spec"]["p"], &obj["spec"]["e"], &obj["metadata"]["name"]), (&json!({ "q": { "deep": 1 } }), &json!({}), &json!("x")));
    }

    #[test]
    #[should_panic(expected = "does not enforce `/properties/spec/x-kubernetes-validations`")]
    fn apiserver_crd_refuses_keywords_it_does_not_enforce() {
        check_supported(
            &json!({ "type": "object", "properties": { "spec": { "type": "string", "x-kubernetes-validations": [{ "rule": "self != ''" }] } } }),
            "",
        );
    }

    #[test]
    #[should_panic(expected = "cannot match `/properties/spec/pattern` of deploy/crd.yaml (^\\s$) as the real server does: \\d, \\s")]
    fn apiserver_crd_refuses_patterns_go_reads_otherwise() {
        check_supported(&json!({ "type": "object", "properties": { "spec": { "type": "string", "pattern": "^\\s$" } } }), "");
    }

    #[test]
    fn apiserver_crd_quotes_strings_as_go() {
        // What Go's strconv.Quote gives.
        let cases = [
            ("eth0", r#""eth0""#),
            ("a\"b\\c", r#""a\"b\\c""#),
            ("\u{7}\u{8}\u{c}\n\r\t\u{b}", r#""\a\b\f\n\r\t\v""#),
            ("\u{1}\u{1b}\u{7f}", r#""\x01\x1b\x7f""#),
            ("é\u{a0}\u{2028}\u{85}", r#""é\u00a0\u2028\u0085""#),
        ];
        for (s, want) in cases {
            assert_eq!(go_quote(s), want, "{s:?}");
        }
    }

    #[test]
    fn apiserver_crd_patterns_go_reads_alike() {
        for same in ["^[^/:[:space:]]+$", "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "^[]a]$", "^[^]a-]+$", "a\\.b", "^\\\\d$", "[[:alpha:]-]"] {
            assert_eq!(go_regexp_differs(same), None, "{same}");
        }
        for differs in ["\\d", "[\\w]", "\\bx", "[a[bc]]", "[a&&b]", "[a--b]", "[a~~b]"] {
            assert!(go_regexp_differs(differs).is_some(), "{differs}");
        }
    }
}
