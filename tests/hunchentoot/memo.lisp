;;;; memo.lisp -- Hunchentoot's per-request helpers that Gallop remembers
;;;; (src/hunchentoot/memo.lisp) give what Hunchentoot's own give: the Date of
;;;; the current second, each connection's own addresses, and the content
;;;; type with its charset for every (content type, external format) pair.

(in-package #:gallop-tests)
(in-suite requests)

(defun charset-of (content-type external-format)
  (hunchentoot::maybe-add-charset-to-content-type-header
   content-type (flex:make-external-format external-format)))

(test content-type-charsets-are-hunchentoots
  ;; Each call twice: the first (memo emptied) is Hunchentoot's own, the
  ;; second comes from the memo and must be the same.
  (setf gallop::*charset-memo* '())
  (let ((cases '(("text/plain" :utf-8) ("text/plain" :latin-1) ("TEXT/Html" :utf-8)
                 ("text/html; charset=latin-1" :utf-8) ("text/html;Charset=x" :utf-8)
                 ("application/json" :utf-8) ("texture/x" :utf-8) ("" :utf-8)
                 ("text/css" :utf-8) ("text/csv" :utf-8) ("text/xml" :utf-8))))
    (loop for (content-type format) in cases
          do (setf gallop::*charset-memo* '())
             (let* ((own (charset-of content-type format))
                    (memo (charset-of content-type format)))
               (is (string= own memo) "~S ~S: ~S, then ~S" content-type format own memo)
               ;; unchanged: the very argument, as Hunchentoot's own returns it
               (is (eq (eq own content-type) (eq memo content-type)))))
    ;; what Hunchentoot's own does, pinned
    (setf gallop::*charset-memo* '())
    (is (equal "text/plain; charset=utf-8" (charset-of "text/plain" :utf-8)))
    (is (equal "text/plain; charset=iso-8859-1" (charset-of "text/plain" :latin-1)))
    (is (equal "text/plain; charset=utf-8" (charset-of "text/plain" :utf-8)))
    (let ((json "application/json"))
      (is (eq json (charset-of json :utf-8)))
      (is (eq json (charset-of json :utf-8))))
    ;; all of them in turn, twice, with more pairs than the memo holds
    (let ((expected (loop for (content-type format) in cases
                          collect (progn (setf gallop::*charset-memo* '())
                                         (charset-of content-type format)))))
      (setf gallop::*charset-memo* '())
      (loop for (content-type format) in (append cases cases)
            for own in (append expected expected)
            do (is (string= own (charset-of content-type format)))))
    ;; an external format that is not a flexi-streams object (a reply's may
    ;; be anything STRING-TO-OCTETS takes): Hunchentoot's own asks for its
    ;; name only for a text type without a charset, so a JSON reply is
    ;; answered, a text one fails, from the memo as from the original
    (setf gallop::*charset-memo* '())
    (dotimes (i 2)
      (is (equal "application/json"
                 (hunchentoot::maybe-add-charset-to-content-type-header "application/json" :utf-8)))
      (signals error
        (hunchentoot::maybe-add-charset-to-content-type-header "text/plain" :utf-8)))
    ;; an added charset comes in a fresh string each time
    (is (not (eq (charset-of "text/plain" :utf-8) (charset-of "text/plain" :utf-8))))
    ;; the memo keeps its own copy of the content type: changing the caller's
    ;; string after the call changes nothing
    (setf gallop::*charset-memo* '())
    (let ((content-type (copy-seq "text/plain")))
      (charset-of content-type :utf-8)
      (setf (char content-type 0) #\T)
      (is (equal "Text/plain; charset=utf-8" (charset-of content-type :utf-8)))
      (is (equal "text/plain; charset=utf-8" (charset-of (copy-seq "text/plain") :utf-8))))))

(test rfc-1123-date-is-the-current-seconds
  (flet ((bracketed-p (date before after)
           ;; the original runs when given a time
           (loop for time from before to after
                 thereis (string= date (hunchentoot:rfc-1123-date time)))))
    (let* ((before (get-universal-time))
           (first (hunchentoot:rfc-1123-date))
           (second (hunchentoot:rfc-1123-date))
           (after (get-universal-time)))
      (is (bracketed-p first before after) "~S not within ~D..~D" first before after)
      (is (bracketed-p second before after))
      (is (not (eq first second)) "a fresh string for each caller"))
    ;; a date remembered for an earlier second is not given for this one
    (let ((now (get-universal-time)))
      (setf gallop::*rfc-1123-date* (cons (- now 5) "Stale, 01 Jan 2000 00:00:00 GMT"))
      (let ((date (hunchentoot:rfc-1123-date)))
        (is (bracketed-p date now (get-universal-time)) "~S" date)))
    ;; over the wire: each answer's Date is its second's
    (with-server (server 'gallop:easy-acceptor)
      (let ((socket (connect (port-of server))))
        (unwind-protect
             (dotimes (i 2)
               (let* ((before (get-universal-time))
                      (response (progn (send socket (crlf "GET /wire/plain?x=d HTTP/1.1" "Host: h"))
                                       (read-wire socket :persistent t)))
                      (after (get-universal-time)))
                 (is (equal "plain d" (wire-body-string response)))
                 (is (bracketed-p (wire-header response "Date") before after)
                     "Date ~S not within ~D..~D" (wire-header response "Date") before after)))
          (usocket:socket-close socket))))))
