;;;; octets.lisp -- GALLOP.CORE's matching of octets against names known at
;;;; compile time (OCTETS-CASE, OCTETS-MATCH-P) and its scans (LINE-END,
;;;; OCTET-POSITION), on byte vectors: no sockets, milliseconds.  Each name
;;;; is tried in place of every octet value at every position, alone and
;;;; inside a larger buffer.
;;;;
;;;; Internals of GALLOP.CORE reached on purpose: LINE-END and OCTETS-
;;;; MATCH-P (os/buffers.lisp), scans under test beside the exported OCTETS-
;;;; CASE and OCTET-POSITION.

(in-package #:gallop-tests)

(in-suite core)

(defun octets-in (string &key (before "") (after ""))
  "STRING (chars below 256) as octets between BEFORE and AFTER: the buffer, and
the start and end of STRING in it."
  (let ((all (concatenate 'string before string after)))
    (values (map '(simple-array (unsigned-byte 8) (*)) #'char-code all)
            (length before)
            (+ (length before) (length string)))))

(defun field-name-kind (buffer start end)
  "Case-insensitive: names of different lengths sharing prefixes."
  (gallop.core:octets-case (buffer start end :ignore-case t)
    ("host" :host)
    ("hos" :hos)
    ("hosts" :hosts)
    ("content-length" :content-length)
    ("content-type" :content-type)
    ("content-md5" :content-md5)
    ("connection" :connection)
    ("te" :te)
    ("" :empty)
    (t :other)))

(defun method-kind (buffer start end)
  "Exact: method names, some of one length."
  (gallop.core:octets-case (buffer start end)
    ("GET" :get)
    ("PUT" :put)
    ("POST" :post)
    ("HEAD" :head)
    ("PATCH" :patch)
    ("DELETE" :delete)
    (t :other)))

(defun method-kind-no-default (buffer start end)
  "No T clause; a clause with no body; two forms in a body; a name twice."
  (gallop.core:octets-case (buffer start end)
    ("GET" :get)
    ("NIX")
    ("TWO" :first-form :second-form)
    ("GET" :second-get)))

(defun octets-from (list)
  (coerce list '(simple-array (unsigned-byte 8) (*))))

(test octets-case-exact
  (dolist (case '(("GET" :get) ("PUT" :put) ("POST" :post) ("HEAD" :head) ("PATCH" :patch)
                  ("DELETE" :delete)
                  ;; case matters
                  ("get" :other) ("Get" :other) ("post" :other) ("gET" :other)
                  ;; prefixes and extensions of the names
                  ("GE" :other) ("GETS" :other) ("G" :other) ("" :other) ("POS" :other)
                  ("POSTS" :other) ("HEADS" :other) ("PATC" :other) ("DELETED" :other)
                  ("PU" :other) (" GET" :other) ("GET " :other)))
    (destructuring-bind (name expected) case
      (multiple-value-bind (buffer start end) (octets-in name)
        (is (eq expected (method-kind buffer start end)) "~S: ~S" name (method-kind buffer start end)))
      ;; the same inside a larger buffer whose other octets would match
      (multiple-value-bind (buffer start end) (octets-in name :before "GETPOST" :after "HEAD")
        (is (eq expected (method-kind buffer start end))
            "~S in a larger buffer: ~S" name (method-kind buffer start end))))))

(test octets-case-ignore-case
  (dolist (case '(("host" :host) ("HOST" :host) ("HoSt" :host) ("hOsT" :host)
                  ("hos" :hos) ("HOS" :hos) ("hosts" :hosts) ("HOSTS" :hosts)
                  ("ho" :other) ("h" :other) ("hostss" :other) ("ghost" :other)
                  ("host " :other) (" host" :other) ("hos t" :other)
                  ("content-length" :content-length) ("Content-Length" :content-length)
                  ("CONTENT-LENGTH" :content-length) ("content-type" :content-type)
                  ("Content-Type" :content-type) ("content-MD5" :content-md5)
                  ("content-lengt" :other) ("content-lengths" :other)
                  ("content_length" :other) ("content-typ" :other)
                  ("connection" :connection) ("Connection" :connection)
                  ("te" :te) ("TE" :te) ("Te" :te) ("t" :other) ("tee" :other)
                  ("" :empty)))
    (destructuring-bind (name expected) case
      (multiple-value-bind (buffer start end) (octets-in name)
        (is (eq expected (field-name-kind buffer start end))
            "~S: ~S" name (field-name-kind buffer start end)))
      (multiple-value-bind (buffer start end) (octets-in name :before "Host: " :after ": host")
        (is (eq expected (field-name-kind buffer start end))
            "~S in a larger buffer: ~S" name (field-name-kind buffer start end))))))

(test octets-case-default-and-clause-bodies
  (flet ((try (name)
           (multiple-value-list
            (multiple-value-bind (buffer start end) (octets-in name)
              (method-kind-no-default buffer start end)))))
    (is (equal '(:get) (try "GET")) "the first of two clauses with one name wins")
    (is (equal '(nil) (try "NIX")) "a clause with no body gives NIL")
    (is (equal '(:second-form) (try "TWO")) "a body's forms run as a PROGN")
    (is (equal '(nil) (try "get")) "no T clause: NIL")
    (is (equal '(nil) (try "")) "no T clause, empty range: NIL"))
  ;; the T clause's forms run as a PROGN too, once
  (let ((runs 0))
    (is (eq :default (multiple-value-bind (buffer start end) (octets-in "nope")
                       (gallop.core:octets-case (buffer start end)
                         ("yes" :yes)
                         (t (incf runs) :default)))))
    (is (= 1 runs)))
  ;; the T clause only as the last, and names in lower case when ignoring case
  (signals error (macroexpand-1 '(gallop.core:octets-case (b 0 1) (t 1) ("a" 2))))
  (is-true (nth-value 2 (handler-bind ((warning #'muffle-warning))
                          (compile nil '(lambda (b)
                                         (gallop.core:octets-case (b 0 4 :ignore-case t)
                                           ("Host" 1))))))
           "an upper-case name compiled with :IGNORE-CASE")
  (signals error (macroexpand-1 '(gallop.core::octets-match-p b 0 1 "Host" :ignore-case t))))

(test octets-case-evaluates-its-arguments-once
  (let ((evaluations '()))
    (multiple-value-bind (buffer start end) (octets-in "DELETE" :before "xx")
      (is (eq :delete (gallop.core:octets-case ((progn (push :buffer evaluations) buffer)
                                                (progn (push :start evaluations) start)
                                                (progn (push :end evaluations) end))
                        ("GET" :get) ("HEAD" :head) ("PATCH" :patch) ("DELETE" :delete)
                        (t :other))))
      (is (equal '(:end :start :buffer) evaluations))
      (setf evaluations '())
      (is-true (gallop.core::octets-match-p (progn (push :buffer evaluations) buffer)
                                           (progn (push :start evaluations) start)
                                           (progn (push :end evaluations) end)
                                           "delete" :ignore-case t))
      (is (equal '(:end :start :buffer) evaluations)))))

(test octets-match-p-empty-ranges-and-sub-ranges
  (let ((empty (octets-from '()))
        (buffer (octets-in "xhostile host HOST te")))
    ;; empty ranges: at 0 of an empty buffer, inside and at the end of one
    (is-true (gallop.core::octets-match-p empty 0 0 ""))
    (is-false (gallop.core::octets-match-p empty 0 0 "a"))
    (is-true (gallop.core::octets-match-p buffer 3 3 ""))
    (is-true (gallop.core::octets-match-p buffer (length buffer) (length buffer) "" :ignore-case t))
    (is-false (gallop.core::octets-match-p buffer 3 3 "h" :ignore-case t))
    (is (eq :empty (field-name-kind empty 0 0)))
    (is (eq :empty (field-name-kind buffer 5 5)))
    (is (eq :other (method-kind empty 0 0)))
    ;; sub-ranges: only BUFFER[START,END) counts
    (is-true (gallop.core::octets-match-p buffer 1 5 "host"))
    (is-false (gallop.core::octets-match-p buffer 0 5 "host"))
    (is-false (gallop.core::octets-match-p buffer 1 6 "host"))
    (is-false (gallop.core::octets-match-p buffer 1 4 "host"))
    (is-false (gallop.core::octets-match-p buffer 2 6 "host"))
    (is-true (gallop.core::octets-match-p buffer 1 8 "hostile"))
    (is-true (gallop.core::octets-match-p buffer 9 13 "host"))
    (is-false (gallop.core::octets-match-p buffer 14 18 "host"))
    (is-true (gallop.core::octets-match-p buffer 14 18 "HOST"))
    (is-true (gallop.core::octets-match-p buffer 14 18 "host" :ignore-case t))
    (is (eq :host (field-name-kind buffer 1 5)))
    (is (eq :hos (field-name-kind buffer 1 4)))
    (is (eq :other (field-name-kind buffer 0 5)))
    (is (eq :host (field-name-kind buffer 14 18)))
    (is (eq :other (field-name-kind buffer 4 6)))      ; "ti"
    (is (eq :te (field-name-kind buffer 19 21)))))

(defun substitution-failures (name matcher ignore-case)
  "Put each octet value 0..255 in place of each octet of NAME (alone and inside
a larger buffer) and call MATCHER on the result: a list of the substitutions
whose answer is not the expected one.  The expected answer: a match iff the
octet is NAME's, or, with IGNORE-CASE, the other case of an ASCII letter."
  (let ((failures '()))
    (dotimes (position (length name))
      (dotimes (octet 256)
        (let* ((ch (char name position))
               (matches (or (= octet (char-code ch))
                            (and ignore-case (alpha-char-p ch)
                                 (= octet (char-code (char-upcase ch))))))
               (string (let ((s (copy-seq name)))
                         (setf (char s position) (code-char octet))
                         s)))
          (dolist (context '(("" "") ("GET host: " " HOST")))
            (multiple-value-bind (buffer start end)
                (octets-in string :before (first context) :after (second context))
              (unless (eq (and (funcall matcher buffer start end) t) matches)
                (push (list name position octet (if matches :missed :matched)) failures)))))))
    (nreverse failures)))

(test octets-match-p-every-octet-in-every-position
  ;; Case-insensitive: exactly the two ASCII cases of a letter match; a
  ;; Latin-1 letter (#xC8, E grave, = #x48 + #x80) never does; non-letters
  ;; (#\- and its bit-5 twin #x0D, digits, @ [ ` {) match exactly.
  (macrolet ((exhaust (name ignore-case)
               `(let ((failures (substitution-failures
                                 ,name
                                 (lambda (buffer start end)
                                   (gallop.core::octets-match-p buffer start end ,name
                                                               :ignore-case ,ignore-case))
                                 ,ignore-case)))
                  (is (null failures) "~S~:[~; ignoring case~]: ~D wrong, e.g. ~S"
                      ,name ,ignore-case (length failures) (subseq failures 0 (min 5 (length failures)))))))
    (exhaust "host" t)
    (exhaust "content-md5" t)
    (exhaust "x@[`{~" t)
    (exhaust "GET" nil)
    (exhaust "Content-Type" nil)))

(test octets-case-every-octet-in-every-position
  (flet ((exhaust (names kind function ignore-case)
           (dolist (name names)
             (let ((failures (substitution-failures
                              name
                              (lambda (buffer start end)
                                (eq kind (funcall function buffer start end)))
                              ignore-case)))
               (is (null failures) "~S: ~D wrong, e.g. ~S"
                   name (length failures) (subseq failures 0 (min 5 (length failures))))))))
    (exhaust '("host") :host #'field-name-kind t)
    (exhaust '("hosts") :hosts #'field-name-kind t)
    (exhaust '("content-length") :content-length #'field-name-kind t)
    (exhaust '("te") :te #'field-name-kind t)
    (exhaust '("POST") :post #'method-kind nil)
    (exhaust '("PUT") :put #'method-kind nil)))

(test octets-ignore-case-folds-only-ascii-letters
  (flet ((host-p (&rest codes)
           (let ((buffer (octets-from codes)))
             (eq :host (field-name-kind buffer 0 (length buffer))))))
    (is-true (host-p 104 111 115 116))        ; host
    (is-true (host-p 72 79 83 84))            ; HOST
    (is-false (host-p (+ 72 128) 79 83 84))   ; #xC8 OST
    (is-false (host-p (+ 104 128) 111 115 116)) ; #xE8 ost
    (is-false (host-p 104 (+ 79 128) 115 116))
    (is-false (host-p 104 111 115 (+ 84 128)))
    (is-false (host-p 8 111 115 116)))        ; #x48 without bit 6
  ;; Latin-1 upper-case letters (#xC8 #xC9 #xCA) are the ASCII ones (#x48
  ;; #x49 #x4A) plus #x80: they are no case of "hij".
  (let ((latin1 (octets-from (list 200 201 202))))
    (is-false (gallop.core::octets-match-p latin1 0 3 "hij" :ignore-case t))
    (is-true (gallop.core::octets-match-p (octets-from (list 72 73 74)) 0 3 "hij" :ignore-case t))))

(test line-end-and-octet-position
  (let ((buffer (octets-from '(13 10 65 66 13 67 10 10 0 255 10)))
        (empty (octets-from '())))
    ;; LINE-END: the first LF in [START, END)
    (is (eql 1 (gallop.core::line-end buffer 0 11)))
    (is (eql 1 (gallop.core::line-end buffer 1 11)) "an LF at START")
    (is (eql 6 (gallop.core::line-end buffer 2 11)) "an LF before START does not count")
    (is (eql 6 (gallop.core::line-end buffer 2 7)) "an LF at END - 1")
    (is (eql nil (gallop.core::line-end buffer 2 6)) "an LF at END does not count")
    (is (eql nil (gallop.core::line-end buffer 2 5)) "a bare CR is no line end")
    (is (eql 7 (gallop.core::line-end buffer 7 11)))
    (is (eql 10 (gallop.core::line-end buffer 8 11)))
    (is (eql nil (gallop.core::line-end buffer 3 3)) "empty range")
    (is (eql nil (gallop.core::line-end buffer 11 11)) "empty range at the end")
    (is (eql nil (gallop.core::line-end empty 0 0)))
    ;; OCTET-POSITION: the first OCTET in [START, END)
    (is (eql 0 (gallop.core:octet-position 13 buffer 0 11)))
    (is (eql 4 (gallop.core:octet-position 13 buffer 1 11)))
    (is (eql nil (gallop.core:octet-position 13 buffer 5 11)))
    (is (eql 8 (gallop.core:octet-position 0 buffer 0 11)) "octet 0")
    (is (eql 9 (gallop.core:octet-position 255 buffer 0 11)) "octet 255")
    (is (eql nil (gallop.core:octet-position 255 buffer 0 9)) "at END does not count")
    (is (eql 9 (gallop.core:octet-position 255 buffer 9 10)))
    (is (eql nil (gallop.core:octet-position 65 buffer 3 11)) "before START does not count")
    (is (eql nil (gallop.core:octet-position 65 buffer 2 2)) "empty range")
    (is (eql nil (gallop.core:octet-position 1 buffer 0 11)) "absent")
    (is (eql nil (gallop.core:octet-position 0 empty 0 0))))
  ;; Both against POSITION on random buffers and ranges.
  (let ((random (sb-ext:seed-random-state 1234))
        (failures '()))
    (dotimes (i 2000)
      (let* ((n (random 40 random))
             (buffer (octets-from (loop repeat n collect (if (zerop (random 4 random))
                                                             10
                                                             (random 256 random)))))
             (start (random (1+ n) random))
             (end (+ start (random (1+ (- n start)) random)))
             (octet (if (zerop (random 2 random)) 10 (random 256 random))))
        (unless (eql (gallop.core::line-end buffer start end)
                     (position 10 buffer :start start :end end))
          (push (list :line-end buffer start end) failures))
        (unless (eql (gallop.core:octet-position octet buffer start end)
                     (position octet buffer :start start :end end))
          (push (list :octet-position octet buffer start end) failures))))
    (is (null failures) "~D differ from POSITION, e.g. ~S" (length failures) (first failures))))
