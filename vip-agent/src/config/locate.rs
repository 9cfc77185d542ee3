//! Finds the line of a field path (`services[1].healthCheck.rise`) in a YAML text,
//! so errors found after deserialising (cross-field checks) still name a line.
use yaml_rust2::{
    parser::{Event, MarkedEventReceiver, Parser},
    scanner::Marker,
};

enum Frame {
    /// Inside a mapping: the key whose value comes next (None: expecting a key).
    Map(Option<String>),
    /// Inside a sequence: index of the next item.
    Seq(usize),
}

struct Locator<'a> {
    want: &'a str,
    stack: Vec<Frame>,
    found: Option<usize>,
}

impl Locator<'_> {
    fn path(&self) -> String {
        let mut p = String::new();
        for f in &self.stack {
            match f {
                Frame::Map(Some(k)) => {
                    if !p.is_empty() {
                        p.push('.');
                    }
                    p.push_str(k);
                }
                Frame::Map(None) => {}
                Frame::Seq(i) => p.push_str(&format!("[{i}]")),
            }
        }
        p
    }

    /// A value (scalar or the start of a container) begins at `line`.
    fn value_at(&mut self, line: usize) {
        if self.found.is_none() && self.path() == self.want {
            self.found = Some(line);
        }
    }

    /// A value just ended: advance the enclosing container.
    fn value_done(&mut self) {
        match self.stack.last_mut() {
            Some(Frame::Map(k)) => *k = None,
            Some(Frame::Seq(i)) => *i += 1,
            None => {}
        }
    }
}

impl MarkedEventReceiver for Locator<'_> {
    fn on_event(&mut self, ev: Event, mark: Marker) {
        let line = mark.line();
        match ev {
            Event::Scalar(s, ..) => {
                if let Some(Frame::Map(k @ None)) = self.stack.last_mut() {
                    *k = Some(s);
                    // A key's line stands for its value when the value is on later lines.
                    self.value_at(line);
                    return;
                }
                self.value_at(line);
                self.value_done();
            }
            Event::Alias(_) => {
                self.value_at(line);
                self.value_done();
            }
            Event::MappingStart(..) => {
                self.value_at(line);
                self.stack.push(Frame::Map(None));
            }
            Event::SequenceStart(..) => {
                self.value_at(line);
                self.stack.push(Frame::Seq(0));
            }
            Event::MappingEnd | Event::SequenceEnd => {
                self.stack.pop();
                self.value_done();
            }
            _ => {}
        }
    }
}

/// 1-based line of `path` in `text`, or of its nearest ancestor present.
pub fn line_of(text: &str, path: &str) -> Option<usize> {
    let mut want = path.to_owned();
    loop {
        let mut loc = Locator { want: &want, stack: Vec::new(), found: None };
        if Parser::new_from_str(text).load(&mut loc, false).is_err() {
            return None;
        }
        if loc.found.is_some() || want.is_empty() {
            return loc.found;
        }
        // Not there (a defaulted field): fall back to the enclosing object.
        let cut = want.rfind(['.', '[']).unwrap_or(0);
        want.truncate(cut);
    }
}

#[cfg(test)]
mod tests {
    use super::line_of;

    const DOC: &str =
        "nodes:\n  - name: a\n    address: 1.2.3.4\n  - name: b\n    labels:\n      zone: x\nservices:\n  - name: s\n    healthCheck:\n      rise: 0\n";

    #[test]
    fn finds_nested_fields_and_items() {
        assert_eq!(line_of(DOC, "nodes"), Some(1));
        assert_eq!(line_of(DOC, "nodes[0].address"), Some(3));
        assert_eq!(line_of(DOC, "nodes[1]"), Some(4));
        assert_eq!(line_of(DOC, "nodes[1].labels.zone"), Some(6));
        assert_eq!(line_of(DOC, "services[0].healthCheck.rise"), Some(10));
    }

    #[test]
    fn missing_field_falls_back_to_its_object() {
        assert_eq!(line_of(DOC, "services[0].healthCheck.fall"), Some(9));
        assert_eq!(line_of(DOC, "services[0].tableSize"), Some(8));
    }
}
