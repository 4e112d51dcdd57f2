//! The extra keys of one block, in vLLM's order: LoRA, the multimodal items overlapping the
//! block, `cache_salt` (block 0 only), prompt-embeds digest.
//!
//! Keys are produced as borrowed [`Key`]s through a callback, so serialising a block allocates
//! nothing. Three shapes exist: the 0.34 tagged hash form, the ≤ 0.24 untagged hash form, and the
//! event form, which is the untagged one (no LoRA path) in every version.

use super::{ExtraKeysFormat, RequestExtras};
use crate::events::ExtraKeyItem;

pub(crate) const TAG_LORA: &str = "lora";
pub(crate) const TAG_MM: &str = "mm";
pub(crate) const TAG_CACHE_SALT: &str = "cache_salt";
pub(crate) const TAG_PROMPT_EMBEDS: &str = "prompt_embeds";

/// One scalar inside an extra key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Atom<'a> {
    /// A tag: a string literal in vLLM's source, hence one shared object in pickle.
    Tag(&'static str),
    /// A string that vLLM received at run time (LoRA name and path, identifier, salt).
    Str(&'a str),
    Bytes(&'a [u8]),
    Int(i64),
}

/// One extra key: a bare scalar (untagged LoRA name, salt, digest) or a tuple.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key<'a> {
    atoms: [Atom<'a>; 3],
    len: u8,
    tuple: bool,
}

impl<'a> Key<'a> {
    fn single(a: Atom<'a>) -> Self {
        Key {
            atoms: [a, Atom::Int(0), Atom::Int(0)],
            len: 1,
            tuple: false,
        }
    }

    fn pair(a: Atom<'a>, b: Atom<'a>) -> Self {
        Key {
            atoms: [a, b, Atom::Int(0)],
            len: 2,
            tuple: true,
        }
    }

    fn triple(a: Atom<'a>, b: Atom<'a>, c: Atom<'a>) -> Self {
        Key {
            atoms: [a, b, c],
            len: 3,
            tuple: true,
        }
    }

    pub(crate) fn atoms(&self) -> &[Atom<'a>] {
        &self.atoms[..usize::from(self.len)]
    }

    pub(crate) fn is_tuple(&self) -> bool {
        self.tuple
    }
}

/// Calls `f` with each extra key of block `block_index`, in vLLM's order.
///
/// A multimodal item belongs to every block its token range `[offset, offset + length)`
/// overlaps, keyed with its offset relative to the block start (negative when it began in an
/// earlier block). vLLM walks its (sorted, disjoint) items with a cursor; for such items that walk
/// selects exactly the overlapping ones.
pub(crate) fn for_each_key<'a>(
    extras: &'a RequestExtras,
    format: ExtraKeysFormat,
    block_index: usize,
    block_size: usize,
    mut f: impl FnMut(Key<'a>),
) {
    let tagged = format == ExtraKeysFormat::Tagged;
    if let Some(lora) = &extras.lora {
        f(if tagged {
            Key::triple(
                Atom::Tag(TAG_LORA),
                Atom::Str(&lora.name),
                Atom::Str(&lora.path),
            )
        } else {
            Key::single(Atom::Str(&lora.name))
        });
    }
    let start = block_index.saturating_mul(block_size);
    let end = start.saturating_add(block_size);
    for item in &extras.mm {
        if item.offset < end && item.offset.saturating_add(item.length) > start {
            let rel = wide(item.offset) - wide(start);
            let rel = i64::try_from(rel).unwrap_or(if rel < 0 { i64::MIN } else { i64::MAX });
            let (id, off) = (Atom::Str(&item.identifier), Atom::Int(rel));
            f(if tagged {
                Key::triple(Atom::Tag(TAG_MM), id, off)
            } else {
                Key::pair(id, off)
            });
        }
    }
    // vLLM tests the salt for truth: an empty salt adds no key.
    if let Some(salt) = extras.cache_salt.as_deref().filter(|s| !s.is_empty()) {
        if block_index == 0 {
            f(if tagged {
                Key::pair(Atom::Tag(TAG_CACHE_SALT), Atom::Str(salt))
            } else {
                Key::single(Atom::Str(salt))
            });
        }
    }
    if let Some(digest) = extras.prompt_embeds_digests.get(block_index) {
        f(if tagged {
            Key::pair(Atom::Tag(TAG_PROMPT_EMBEDS), Atom::Bytes(digest))
        } else {
            Key::single(Atom::Bytes(digest))
        });
    }
}

fn wide(v: usize) -> i128 {
    i128::try_from(v).unwrap_or(i128::MAX)
}

pub(crate) fn count(
    extras: &RequestExtras,
    format: ExtraKeysFormat,
    block_index: usize,
    block_size: usize,
) -> usize {
    let mut n = 0;
    for_each_key(extras, format, block_index, block_size, |_| n += 1);
    n
}

fn atom_item(a: &Atom<'_>) -> ExtraKeyItem {
    match a {
        Atom::Tag(s) => ExtraKeyItem::Str((*s).to_string()),
        Atom::Str(s) => ExtraKeyItem::Str((*s).to_string()),
        Atom::Bytes(b) => ExtraKeyItem::Bytes(b.to_vec()),
        Atom::Int(i) => ExtraKeyItem::Int(*i),
    }
}

/// The key as a KV-event item: a scalar, or an array for a tuple.
pub(crate) fn key_item(k: &Key<'_>) -> ExtraKeyItem {
    if k.is_tuple() {
        ExtraKeyItem::Array(k.atoms().iter().map(atom_item).collect())
    } else {
        atom_item(&k.atoms()[0])
    }
}

/// The keys of a block as KV-event items (untagged, LoRA name only); `None` when there are none,
/// as vLLM sends `None` for such a block.
pub(crate) fn event_items(
    extras: &RequestExtras,
    block_index: usize,
    block_size: usize,
) -> Option<Vec<ExtraKeyItem>> {
    let mut items = Vec::new();
    for_each_key(
        extras,
        ExtraKeysFormat::Untagged,
        block_index,
        block_size,
        |k| items.push(key_item(&k)),
    );
    (!items.is_empty()).then_some(items)
}

/// The keys of a block in a hash format, as items (for display and tests).
pub(crate) fn hash_items(
    extras: &RequestExtras,
    format: ExtraKeysFormat,
    block_index: usize,
    block_size: usize,
) -> Option<Vec<ExtraKeyItem>> {
    let mut items = Vec::new();
    for_each_key(extras, format, block_index, block_size, |k| {
        items.push(key_item(&k))
    });
    (!items.is_empty()).then_some(items)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hashing::{Lora, MmItem};

    fn mm(id: &str, offset: usize, length: usize) -> MmItem {
        MmItem {
            identifier: id.to_string(),
            offset,
            length,
        }
    }

    fn tagged(extras: &RequestExtras, block: usize) -> Vec<Key<'_>> {
        let mut keys = Vec::new();
        for_each_key(extras, ExtraKeysFormat::Tagged, block, 16, |k| keys.push(k));
        keys
    }

    #[test]
    fn mm_items_key_every_overlapped_block_with_relative_offset() {
        let extras = RequestExtras {
            mm: vec![mm("img", 5, 20)],
            ..RequestExtras::default()
        };
        let k0 = tagged(&extras, 0);
        assert_eq!(
            k0[0].atoms(),
            &[Atom::Tag("mm"), Atom::Str("img"), Atom::Int(5)]
        );
        let k1 = tagged(&extras, 1);
        assert_eq!(
            k1[0].atoms(),
            &[Atom::Tag("mm"), Atom::Str("img"), Atom::Int(-11)]
        );
        assert!(tagged(&extras, 2).is_empty());
    }

    #[test]
    fn mm_item_ending_at_block_start_does_not_key_that_block() {
        let extras = RequestExtras {
            mm: vec![mm("a", 0, 16), mm("b", 16, 0), mm("c", 20, 0)],
            ..RequestExtras::default()
        };
        // "b" is empty and sits on the boundary: vLLM's cursor skips it in both blocks.
        assert_eq!(tagged(&extras, 0).len(), 1);
        let k1 = tagged(&extras, 1);
        assert_eq!(k1.len(), 1);
        assert_eq!(k1[0].atoms()[1], Atom::Str("c"));
    }

    #[test]
    fn salt_only_on_block_zero_and_empty_salt_ignored() {
        let mut extras = RequestExtras {
            lora: Some(Lora {
                name: "n".into(),
                path: "/p".into(),
            }),
            cache_salt: Some("s".into()),
            ..RequestExtras::default()
        };
        assert_eq!(count(&extras, ExtraKeysFormat::Tagged, 0, 16), 2);
        assert_eq!(count(&extras, ExtraKeysFormat::Tagged, 1, 16), 1);
        extras.cache_salt = Some(String::new());
        assert_eq!(count(&extras, ExtraKeysFormat::Tagged, 0, 16), 1);
    }

    #[test]
    fn event_form_is_untagged_without_lora_path() {
        let extras = RequestExtras {
            lora: Some(Lora {
                name: "sql".into(),
                path: "/adapters/sql".into(),
            }),
            mm: vec![mm("img", 3, 2)],
            cache_salt: Some("t".into()),
            prompt_embeds_digests: vec![vec![1, 2]],
        };
        assert_eq!(
            event_items(&extras, 0, 16),
            Some(vec![
                ExtraKeyItem::Str("sql".into()),
                ExtraKeyItem::Array(vec![ExtraKeyItem::Str("img".into()), ExtraKeyItem::Int(3)]),
                ExtraKeyItem::Str("t".into()),
                ExtraKeyItem::Bytes(vec![1, 2]),
            ])
        );
        assert_eq!(event_items(&RequestExtras::default(), 0, 16), None);
    }
}
