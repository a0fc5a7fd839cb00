//! Chat templates: turning a conversation into the exact prompt text a chat model was trained on.
//!
//! Models ship their own Jinja template (Hugging Face `tokenizer_config.json` / `chat_template.jinja`, or the GGUF
//! key `tokenizer.chat_template`); rendering it ourselves, with the same environment `transformers` uses, is the
//! only way to get the prompt right for every model. minijinja is Jinja2 minus Python, so the environment adds back
//! what real templates rely on: Python string/dict methods (`.strip()`, `.items()`, via minijinja-contrib's
//! pycompat), `raise_exception`, `strftime_now`, a Python-compatible `tojson`, and Jinja2's `trim_blocks` /
//! `lstrip_blocks`, which `transformers` turns on.
use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind};

use crate::error::{ModelError, Result};

/// One turn of a conversation, in the shape every chat template expects (`message['role']`, `message['content']`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (templates may accept others, e.g. `tool`).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// Name under which the single template is stored in its environment.
const TEMPLATE_NAME: &str = "chat";

/// A compiled chat template plus the special-token texts templates refer to as `bos_token` / `eos_token`.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
    renders_bos: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("renders_bos", &self.renders_bos)
            .field("source_len", &self.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here rather than at the first chat request.
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self> {
        let mut env = Environment::new();
        // transformers renders with `jinja2.Environment(trim_blocks=True, lstrip_blocks=True)`; templates are
        // written against that whitespace behaviour.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ModelError::ChatTemplate(format!("syntax config: {e}")))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        minijinja_contrib::add_to_environment(&mut env);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| ModelError::ChatTemplate(describe(&e)))?;
        let mut template = Self {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
            renders_bos: false,
        };
        template.renders_bos = template.probe_renders_bos();
        Ok(template)
    }

    /// Renders the conversation; with `add_generation_prompt` the text ends where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ModelError::ChatTemplate(describe(&e)))?;
        let messages: Vec<Value> = messages
            .iter()
            .map(|m| context! { role => m.role.clone(), content => m.content.clone() })
            .collect();
        let ctx = context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.clone().unwrap_or_default(),
            eos_token => self.eos_token.clone().unwrap_or_default(),
        };
        template
            .render(ctx)
            .map_err(|e| ModelError::ChatTemplate(describe(&e)))
    }

    /// True when rendered prompts already start with the BOS token's text (Llama 2/3 templates write
    /// `{{ bos_token }}` themselves), so the caller must encode them without adding another BOS.
    pub fn renders_bos(&self) -> bool {
        self.renders_bos
    }

    /// The Jinja source, e.g. to look for end-of-turn markers it uses.
    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders a one-message conversation once to see whether the template emits BOS itself. A template that
    /// rejects that conversation (some insist on a system turn) is tried with one; failing both we assume not.
    fn probe_renders_bos(&self) -> bool {
        let Some(bos) = self.bos_token.as_deref().filter(|b| !b.is_empty()) else {
            return false;
        };
        let probes = [
            vec![ChatMessage::user("hi")],
            vec![ChatMessage::system("s"), ChatMessage::user("hi")],
        ];
        probes
            .iter()
            .find_map(|messages| self.render(messages, true).ok())
            .is_some_and(|text| text.starts_with(bos))
    }
}

/// Full error text including minijinja's template location, which `Display` alone omits for nested causes.
fn describe(err: &minijinja::Error) -> String {
    let mut text = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        let _ = write!(text, ": {cause}");
        source = cause.source();
    }
    text
}

/// `raise_exception(msg)`: HF templates call it to reject conversations they cannot format.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `strftime_now(format)`: Llama 3.x templates put today's date in the system prompt. Supports the common
/// directives (`%d %-d %e %m %-m %Y %y %b %B %a %A %H %M %S %j %%`) on UTC time, which is all templates use.
fn strftime_now(format: String) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime_utc(&format, secs)
}

/// Formats UNIX time `secs` (UTC) with a strftime subset; unknown directives are copied through unchanged.
pub(crate) fn strftime_utc(format: &str, secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 with Monday = 0).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let yday = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(spec) = chars.next() else {
            out.push('%');
            break;
        };
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let piece = match spec {
            'd' => num(day, 2),
            'e' => format!("{day:>2}"),
            'm' => num(month, 2),
            'Y' => year.to_string(),
            'y' => num(year.rem_euclid(100), 2),
            'b' | 'h' => month_name[..3].to_string(),
            'B' => month_name.to_string(),
            'a' => day_name[..3].to_string(),
            'A' => day_name.to_string(),
            'H' => num(hour as i64, 2),
            'M' => num(minute as i64, 2),
            'S' => num(second as i64, 2),
            'j' => num(yday, 3),
            '%' => "%".to_string(),
            other => {
                if no_pad {
                    format!("%-{other}")
                } else {
                    format!("%{other}")
                }
            }
        };
        out.push_str(&piece);
    }
    out
}

/// Days since 1970-01-01 -> (year, month 1..=12, day 1..=31), proleptic Gregorian (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// Inverse of [`civil_from_days`].
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as transformers defines it: `json.dumps(x, ensure_ascii=False, indent=indent, sort_keys=sort_keys)`.
/// minijinja's own filter HTML-escapes `<`, `>`, `&` and `'` and uses other separators, which would change the
/// prompt text of tool-calling templates.
fn tojson(value: &Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, value, indent, sort_keys.unwrap_or(false), 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    indent: Option<usize>,
    sort_keys: bool,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    if depth > 128 {
        return Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            "tojson: value nested too deeply",
        ));
    }
    let newline = |out: &mut String, level: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * level));
        }
    };
    // Python's separators: ", " / ": " without indent, "," / ": " with it.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if value.is_integer() {
                // Integers print as themselves (u128/i128 included), as Python does.
                let _ = write!(out, "{value}");
            } else if let Ok(float) = f64::try_from(value.clone()) {
                if float.is_finite() {
                    // Debug keeps the ".0" Python prints for whole floats.
                    let _ = write!(out, "{float:?}");
                } else if float.is_nan() {
                    out.push_str("NaN");
                } else if float > 0.0 {
                    out.push_str("Infinity");
                } else {
                    out.push_str("-Infinity");
                }
            } else {
                out.push_str(&value.to_string());
            }
        }
        ValueKind::String => push_json_string(out, value.as_str().unwrap_or_default()),
        ValueKind::Map => {
            let mut keys: Vec<Value> = value.try_iter()?.collect();
            if sort_keys {
                keys.sort();
            }
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                match key.as_str() {
                    Some(k) => push_json_string(out, k),
                    None => push_json_string(out, &key.to_string()),
                }
                out.push_str(": ");
                let item = value.get_item(key)?;
                write_json(out, &item, indent, sort_keys, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, sort_keys, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        _ => push_json_string(out, &value.to_string()),
    }
    Ok(())
}

fn push_json_string(out: &mut String, s: &str) {
    match serde_json::to_string(s) {
        Ok(quoted) => out.push_str(&quoted),
        Err(_) => out.push_str("\"\""),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-23 12:34:56 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_738_096;
        assert_eq!(strftime_utc("%d %b %Y", t), "23 Jul 2024");
        assert_eq!(
            strftime_utc("%A %B %-d, %H:%M:%S %j %%", t),
            "Tuesday July 23, 12:34:56 205 %"
        );
        assert_eq!(strftime_utc("%Y-%m-%d", 0), "1970-01-01");
    }

    #[test]
    fn tojson_matches_python() {
        let tpl = ChatTemplate::new(
            "{{ {'a': [1, 2.0, 'x<y'], 'b': none, 'c': true} | tojson }}",
            None,
            None,
        )
        .unwrap();
        let text = tpl.render(&[], false).unwrap();
        assert_eq!(text, r#"{"a": [1, 2.0, "x<y"], "b": null, "c": true}"#);
    }

    #[test]
    fn raise_exception_is_an_error() {
        let tpl = ChatTemplate::new(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok",
            None,
            None,
        )
        .unwrap();
        let err = tpl
            .render(&[ChatMessage::assistant("x")], false)
            .unwrap_err();
        assert!(
            matches!(err, ModelError::ChatTemplate(ref m) if m.contains("first must be user")),
            "{err}"
        );
        assert_eq!(tpl.render(&[ChatMessage::user("x")], false).unwrap(), "ok");
    }

    #[test]
    fn pycompat_methods_and_bos_detection() {
        let tpl = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'].strip() }}\n{% endfor %}",
            Some("<s>".into()),
            Some("</s>".into()),
        )
        .unwrap();
        assert!(tpl.renders_bos());
        let text = tpl.render(&[ChatMessage::user("  hi  ")], false).unwrap();
        assert_eq!(text, "<s>[user] hi\n");
    }

    #[test]
    fn syntax_errors_are_reported() {
        let err = ChatTemplate::new("{% for m in messages %}", None, None).unwrap_err();
        assert!(matches!(err, ModelError::ChatTemplate(_)));
    }
}
