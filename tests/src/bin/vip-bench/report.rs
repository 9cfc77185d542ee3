//! One report, rendered two ways: bench.md for people and bench.json for tools.
//!
//! A measured value is a [`Fig`]: its place in bench.json ([`At`]) and its text in
//! bench.md, made together from the one value. [`line!`] writes a line of bench.md
//! with figures in its `{}` placeholders (plain values go in `{name}` captures) and
//! keeps the figures for bench.json; [`Line::with`] adds values that only bench.json
//! holds (all samples, counts). A place can be given once only.
use anyhow::{bail, Result};
use serde_json::{Map, Value};

/// A place in bench.json: a top-level key and the fields below it.
#[derive(Clone, Debug)]
pub struct At(Vec<String>);

/// The top-level key `key`.
pub fn at(key: impl Into<String>) -> At {
    At(vec![key.into()])
}

/// A value for bench.json only.
#[derive(Debug)]
pub struct Entry {
    at: At,
    value: Value,
}

/// A value shown in bench.md and recorded in bench.json.
#[derive(Debug)]
pub struct Fig {
    pub entry: Entry,
    pub shown: String,
}

impl At {
    /// The field `name` of the object here.
    pub fn f(&self, name: impl Into<String>) -> At {
        let mut path = self.0.clone();
        path.push(name.into());
        At(path)
    }

    /// A number shown with `decimals` decimals.
    pub fn num(&self, value: f64, decimals: usize) -> Fig {
        self.fig(value, format!("{value:.decimals$}"))
    }

    /// A value shown as it prints (counts, names).
    pub fn show<T: Into<Value> + std::fmt::Display>(&self, value: T) -> Fig {
        let shown = value.to_string();
        self.fig(value, shown)
    }

    /// A value shown as `shown` (another unit or form of the same value).
    pub fn fig(&self, value: impl Into<Value>, shown: String) -> Fig {
        Fig { entry: Entry { at: self.clone(), value: value.into() }, shown }
    }

    /// A value for bench.json only.
    pub fn data(&self, value: impl serde::Serialize) -> Entry {
        Entry { at: self.clone(), value: serde_json::to_value(value).expect("a JSON value") }
    }
}

/// One line (a paragraph, a table row, a title) of bench.md and the values it records.
#[derive(Debug)]
pub struct Line {
    text: String,
    entries: Vec<Entry>,
}

impl Line {
    /// Made by [`line!`].
    pub fn from_parts(text: String, entries: Vec<Entry>) -> Self {
        Self { text, entries }
    }

    /// Also records `entry` (not shown).
    pub fn with(mut self, entry: Entry) -> Self {
        self.entries.push(entry);
        self
    }
}

/// `line!("text {} more {name}", fig, ...)`: a [`Line`] with each [`Fig`]'s text in
/// a `{}` (checked by `format!` at compile time) and the figures kept for bench.json.
macro_rules! line {
    ($fmt:literal $(, $fig:expr)* $(,)?) => {{
        #[allow(unused_mut)]
        let mut entries = Vec::new();
        let text = format!($fmt $(, {
            let f: $crate::report::Fig = $fig;
            entries.push(f.entry);
            f.shown
        })*);
        $crate::report::Line::from_parts(text, entries)
    }};
}
pub(crate) use line;

/// A markdown table: its header and its rows (each a `| ... |` line).
#[derive(Debug)]
pub struct Table {
    head: String,
    rows: Vec<Line>,
}

impl Table {
    /// `columns`: `| a | b |`; `align`: `|---|---:|`.
    pub fn new(columns: &str, align: &str) -> Self {
        Self { head: format!("{columns}\n{align}"), rows: Vec::new() }
    }

    pub fn row(&mut self, line: Line) {
        self.rows.push(line);
    }
}

#[derive(Debug)]
enum Block {
    Text(Line),
    Table(Table),
}

/// A `##` section of bench.md.
#[derive(Debug)]
pub struct Section {
    title: Line,
    blocks: Vec<Block>,
}

impl Section {
    pub fn new(title: Line) -> Self {
        Self { title, blocks: Vec::new() }
    }

    pub fn para(&mut self, line: Line) {
        self.blocks.push(Block::Text(line));
    }

    pub fn table(&mut self, table: Table) {
        self.blocks.push(Block::Table(table));
    }

    fn lines(&self) -> impl Iterator<Item = &Line> {
        std::iter::once(&self.title).chain(self.blocks.iter().flat_map(|b| match b {
            Block::Text(l) => std::slice::from_ref(l).iter(),
            Block::Table(t) => t.rows.iter(),
        }))
    }
}

#[derive(Debug, Default)]
pub struct Report {
    pub sections: Vec<Section>,
}

impl Report {
    pub fn push(&mut self, section: Section) {
        self.sections.push(section);
    }

    pub fn markdown(&self) -> String {
        let mut out = String::new();
        for s in &self.sections {
            out += &format!("## {}\n\n", s.title.text);
            for b in &s.blocks {
                match b {
                    Block::Text(l) => out += &format!("{}\n\n", l.text),
                    Block::Table(t) => {
                        out += &t.head;
                        out.push('\n');
                        for r in &t.rows {
                            out += &format!("{}\n", r.text);
                        }
                        out.push('\n');
                    }
                }
            }
        }
        out
    }

    /// Every recorded value at its place; a place given twice, or below a value
    /// that is not an object, is an error.
    pub fn json(&self) -> Result<Value> {
        let mut root = Map::new();
        for e in self.sections.iter().flat_map(Section::lines).flat_map(|l| &l.entries) {
            let (last, parents) = e.at.0.split_last().expect("a place has a key");
            let mut obj = &mut root;
            for k in parents {
                obj = match obj.entry(k.clone()).or_insert_with(|| Value::Object(Map::new())) {
                    Value::Object(m) => m,
                    _ => bail!("bench.json: {:?} is below a value that is not an object", e.at.0),
                };
            }
            if obj.insert(last.clone(), e.value.clone()).is_some() {
                bail!("bench.json: {:?} given twice", e.at.0);
            }
        }
        Ok(Value::Object(root))
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn one_report_renders_the_same_values_two_ways() {
        let mut s = Section::new(line!("Things ({} bytes)", at("thing").f("bytes").show(32)));
        let mut t = Table::new("| name | ns |", "|---|---:|");
        for (name, ns) in [("a", 1.24), ("b", 2.0)] {
            let a = at(format!("thing {name}"));
            t.row(line!("| {name} | {} |", a.f("ns").num(ns, 1)).with(a.f("samples").data([ns, ns])));
        }
        s.table(t);
        s.para(line!("Latency {} ns.", at("latency").num(17.54, 1)));
        let mut r = Report::default();
        r.push(s);
        assert_eq!(r.markdown(), "## Things (32 bytes)\n\n| name | ns |\n|---|---:|\n| a | 1.2 |\n| b | 2.0 |\n\nLatency 17.5 ns.\n\n");
        assert_eq!(
            r.json().unwrap(),
            json!({
                "thing": { "bytes": 32 },
                "thing a": { "ns": 1.24, "samples": [1.24, 1.24] },
                "thing b": { "ns": 2.0, "samples": [2.0, 2.0] },
                "latency": 17.54
            })
        );
    }

    #[test]
    fn a_place_given_twice_or_below_a_value_is_an_error() {
        let mut s = Section::new(line!("x"));
        s.para(line!("{} {}", at("k").num(1.0, 0), at("k").num(2.0, 0)));
        let mut r = Report::default();
        r.push(s);
        assert!(r.json().unwrap_err().to_string().contains("given twice"));
        let mut s = Section::new(line!("x"));
        s.para(line!("{} {}", at("k").num(1.0, 0), at("k").f("f").num(2.0, 0)));
        let r = Report { sections: vec![s] };
        assert!(r.json().unwrap_err().to_string().contains("not an object"));
    }
}
