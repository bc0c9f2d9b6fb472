;;;; memo.lisp -- what Hunchentoot's START-OUTPUT computes for every answer
;;;; from values that change at most once a second, computed once.
;;;;
;;;; Two of Hunchentoot's helpers are, with the address strings (made once a
;;;; connection by Gallop's request loop, request-loop.lisp), the largest
;;;; part of what the drop-in acceptor spends beyond Gallop's own request
;;;; path (doc/design.md, "The drop-in acceptor's memos"):
;;;;  - RFC-1123-DATE, which START-OUTPUT calls for each answer's Date header:
;;;;    a FORMAT of seven fields;
;;;;  - MAYBE-ADD-CHARSET-TO-CONTENT-TYPE-HEADER, which START-OUTPUT calls for
;;;;    each string body: two CL-PPCRE scans and a FORMAT.
;;;; START-OUTPUT is a plain function, which handlers also reach through
;;;; HUNCHENTOOT:SEND-HEADERS, so each is wrapped here (SB-INT:ENCAPSULATE;
;;;; compat.lisp checks them) to give what Hunchentoot's own gives, computed
;;;; by Hunchentoot's own on a miss and remembered:
;;;;  - the Date string of the current second, a fresh copy for each caller
;;;;    (as the original makes a fresh string), when called without a time;
;;;;    with a time, the original runs;
;;;;  - the content type with its charset, for the last few (content type,
;;;;    external format) pairs seen, the content type compared by its
;;;;    characters, the external format by identity (the reply's default is
;;;;    one object): the original's result depends on nothing else.  When
;;;;    the original would return its argument unchanged, so does this; an
;;;;    added charset comes in a fresh string.  (Not keyed by the format's
;;;;    name: the original asks for it only for a text type without a
;;;;    charset, and a reply's external format need not have one.)
;;;; Off a Gallop worker (*CONNECTION* is NIL: a stock acceptor's thread),
;;;; each wrapper calls Hunchentoot's own function with its arguments and
;;;; does nothing else.

(in-package #:gallop)

;;; Date

(sb-ext:define-load-time-global *rfc-1123-date* (cons -1 "")
  "(universal time . RFC-1123-DATE's string for it), of the last second the
Date header was asked for.  Replaced, never mutated, so that threads read a
consistent pair without a lock.")

(defun current-rfc-1123-date (original)
  "RFC-1123-DATE of now: the string ORIGINAL (Hunchentoot's own) made for
this second, copied."
  (let ((now (get-universal-time))
        (cached *rfc-1123-date*))
    (if (eql now (car cached))
        (copy-seq (the simple-string (cdr cached)))
        (let ((date (funcall original now)))
          (setf *rfc-1123-date* (cons now (copy-seq date)))
          date))))

;;; Content type with charset

(defconstant +charset-memo-size+ 8
  "How many (content type, external format) pairs are remembered.")

(sb-ext:define-load-time-global *charset-memo* '()
  "((content-type external-format . result) ...), newest first, at most
+CHARSET-MEMO-SIZE+; RESULT is :UNCHANGED when the original returned its
argument.  Each CONTENT-TYPE here is a copy nobody else holds.  The list is
replaced, never mutated.")

(defun content-type-with-charset (original content-type external-format)
  "What ORIGINAL (Hunchentoot's MAYBE-ADD-CHARSET-TO-CONTENT-TYPE-HEADER)
returns for CONTENT-TYPE and EXTERNAL-FORMAT, from *CHARSET-MEMO* when it
holds them."
  (if (not (stringp content-type))
      (funcall original content-type external-format)
      (let* ((memo *charset-memo*)
             ;; A loop, not FIND-IF with a closure: that consed on every call.
             (entry (dolist (entry memo nil)
                      (when (and (eq external-format (second entry))
                                 (string= content-type (the string (first entry))))
                        (return entry)))))
        (if entry
            (let ((result (cddr entry)))
              (if (eq result :unchanged) content-type (copy-seq result)))
            (let ((result (funcall original content-type external-format)))
              (setf *charset-memo*
                    (cons (list* (copy-seq content-type) external-format
                                 (if (eq result content-type) :unchanged (copy-seq result)))
                          (subseq memo 0 (min (length memo) (1- +charset-memo-size+)))))
              result)))))

;;; Wrapping Hunchentoot's functions (compat.lisp checks them).

(wrap-hunchentoot-function (hunchentoot-rfc-1123-date)
  (lambda (original &rest time)
    (if (or time (null *connection*))
        (apply original time)
        (current-rfc-1123-date original))))

(wrap-hunchentoot-function (hunchentoot-maybe-add-charset)
  (lambda (original content-type external-format)
    (if *connection*
        (content-type-with-charset original content-type external-format)
        (funcall original content-type external-format))))
