;;;; request.lisp -- the record of the request a connection serves: its head
;;;; as PARSE-HEAD read it, once, and the state of reading its body.
;;;;
;;;; The connection (connection.lisp, and the files built on it up to
;;;; output.lisp) is the transport: fd, buffers, states, deadlines, output.
;;;; A REQUEST is what one request on it is: each connection has one, made
;;;; with it and reused from request to request.  The layers above read the
;;;; head from here and never scan it again: the native API builds its
;;;; environment from it (src/native/request.lisp), the Hunchentoot layer
;;;; Hunchentoot's request data (src/hunchentoot/heads.lisp).
;;;;
;;;; The head's positions are indexes into the connection's input buffer,
;;;; valid from PARSE-HEAD until the body is read (reading the body may move
;;;; the buffer's contents): a layer above reads the head first.
;;;;
;;;; Invariants, once PARSE-HEAD accepted a head:
;;;;   START < TARGET-START <= QUERY-START <= TARGET-END < END, where
;;;;     QUERY-START is the index of the target's first "?" or TARGET-END
;;;;     (the target is any run of visible ASCII with valid %-escapes: its
;;;;     form is the layer above's to judge);
;;;;   FIELDS holds FIELD-COUNT quadruples (name start, name end = the colon,
;;;;     value start, value end, the value without surrounding white space),
;;;;     in the order of the head, each name a token, each value checked;
;;;;   HOST-START is -1 or the bounds of the one Host value;
;;;;   CONTENT-LENGTH is NIL or the one declared length, and then CHUNKED is
;;;;     false; BODY-LENGTH is CONTENT-LENGTH or 0.
;;;; Body state (body.lisp): HEAD-LEFT octets of the head the layer above has
;;;; not read through the stream; BODY-MODE NIL, :LENGTH (BODY-LEFT octets to
;;;; go) or :CHUNKED (DECODER's state, and SYNTH* while a chunked body is
;;;; passed on re-chunked), or :SPOOL (the engine read the whole body before
;;;; the handler, into SPOOL: BODY-LEFT octets of it to go).  While GATHERING,
;;;; the engine is reading the body into SPOOL; PROGRESS is when octets last
;;;; came.  RATE-START (when the body began, or 0) and RATE-OCTETS (octets
;;;; of it since) measure the client's rate against the engine's minimum.

(in-package #:gallop.core)

(defconstant +max-header-fields+ 1000
  "Header fields a request head may have; more get 431 (Apache allows 100,
Node.js 2000).  Bounds the record of a head's fields to 16 KB.")

(defconstant +initial-fields+ 16
  "Header fields a record has room for at first (it grows as needed).")

(defconstant +kept-fields+ 64
  "Header fields a record keeps room for between requests; after a request
that needed more, the index is dropped (see RELEASE-REQUEST-FIELDS).")

(deftype field-index () '(simple-array (unsigned-byte 32) (*)))

(defstruct (request (:constructor make-request ()) (:copier nil) (:predicate nil))
  "The request a connection serves (see the file's header)."
  ;; The head, as PARSE-HEAD read it
  (start 0 :type fixnum)
  (end 0 :type fixnum)
  (method nil :type symbol)
  (minor 1 :type (integer 0 1))
  (target-start 0 :type fixnum)
  (target-end 0 :type fixnum)
  (query-start 0 :type fixnum)
  (fields nil :type (or null field-index))
  (field-count 0 :type fixnum)
  (host-start -1 :type fixnum)
  (host-end -1 :type fixnum)
  (content-length nil :type (or null (integer 0 999999999999999999)))
  (body-length 0 :type fixnum)
  (chunked nil :type boolean)
  (expect-continue nil :type boolean)
  (keep-alive nil :type boolean)
  (close-after nil :type boolean)
  ;; Reading it (body.lisp)
  (head-left 0 :type fixnum)
  (body-mode nil :type (member nil :length :chunked :spool))
  (body-left 0 :type fixnum)
  (chunk-decoder nil)
  (synth nil)
  (synth-pos 0 :type fixnum)
  (synth-data-left 0 :type fixnum)
  (synth-done nil)
  (synth-octet nil)
  (framing-broken nil)
  (message nil)
  ;; The body the engine reads before the handler (GATHER-BODY, serve.lisp)
  (spool nil)
  (gathering nil :type boolean)
  (progress 0 :type fixnum)
  ;; The minimum data rate of a body being read (0: none applies)
  (rate-start 0 :type fixnum)
  (rate-octets 0 :type fixnum)
  ;; For the metrics: when (NOW-US) this request's head was complete and
  ;; checked, 0 from the end of the request until the next head is; and
  ;; whether its answer was counted (CONNECTION-COUNT-ANSWER).
  (begun 0 :type fixnum)
  (answered nil :type boolean))

(defmethod print-object ((request request) stream)
  (print-unreadable-object (request stream :type t :identity t)))

;;; Naming a field.  A request's fields are read through the struct's own
;;; accessors, (REQUEST-BODY-MODE R), never as slots of the connection
;;; (CONN-SLOT refuses them); a function touching several names them with
;;; WITH-REQUEST-SLOTS.

(eval-when (:compile-toplevel :load-toplevel :execute)
  (defun request-field-name-p (name)
    "True when NAME names a field of REQUEST: a slot of the struct, or
REQUEST-METHOD (its slot METHOD is a COMMON-LISP symbol)."
    (and (symbolp name)
         (or (eq name 'request-method)
             (and (find name (sb-mop:class-slots (find-class 'request))
                        :key #'sb-mop:slot-definition-name)
                  t))))

  (defun request-field-accessor (name)
    "The accessor of REQUEST's field NAME (see REQUEST-FIELD-NAME-P)."
    (if (eq name 'request-method)
        'request-method
        (intern (concatenate 'string (symbol-name 'request-) (symbol-name name))
                (symbol-package 'request)))))

(defmacro with-request-slots ((&rest names) request &body body)
  "WITH-SLOTS for the REQUEST record REQUEST, through its accessors: each of
NAMES, a field (REQUEST-FIELD-NAME-P), is the place (REQUEST-NAME R)."
  (dolist (name names)
    (unless (request-field-name-p name)
      (error "~S is not a field of REQUEST." name)))
  (let ((var (gensym "REQUEST")))
    `(let ((,var ,request))
       (declare (type request ,var) (ignorable ,var))
       (symbol-macrolet ,(loop for name in names
                               collect `(,name (,(request-field-accessor name) ,var)))
         ,@body))))

;; Inline: once per header field, and its full call cost more than its work.
(declaim (inline request-field-slot))
(defun request-field-slot (request)
  "Room in REQUEST's field index for one more field: the index of its first
entry (the index grows as needed)."
  (let* ((fields (request-fields request))
         (i (* 4 (request-field-count request))))
    (declare (type fixnum i))
    (when (or (null fields) (>= i (length fields)))
      (let ((bigger (make-array (* 4 (if fields (* 2 (floor (length fields) 4)) +initial-fields+))
                                :element-type '(unsigned-byte 32))))
        (when fields (replace bigger fields))
        (setf (request-fields request) bigger)))
    i))

(defun shift-request (request delta)
  "The head REQUEST records moved DELTA octets in its buffer (negative: to
the front): move every index with it."
  (declare (type fixnum delta))
  (incf (request-start request) delta)
  (incf (request-end request) delta)
  (incf (request-target-start request) delta)
  (incf (request-target-end request) delta)
  (incf (request-query-start request) delta)
  (when (>= (request-host-start request) 0)
    (incf (request-host-start request) delta)
    (incf (request-host-end request) delta))
  (let ((fields (request-fields request)))
    (when fields
      (dotimes (k (* 4 (request-field-count request)))
        (setf (aref fields k) (+ (aref fields k) delta)))))
  request)

(defun release-request-fields (request)
  "After a request with many header fields: give their index back, so that
an idle connection holds at most room for +KEPT-FIELDS+."
  (let ((fields (request-fields request)))
    (when (and fields (> (length fields) (* 4 +kept-fields+)))
      (setf (request-fields request) nil))))

(declaim (inline request-field))
(defun request-field (request i)
  "The bounds of header field I of REQUEST: name start and end, value start
and end."
  (let ((fields (request-fields request))
        (k (* 4 i)))
    (declare (type field-index fields) (type fixnum k))
    (values (aref fields k) (aref fields (+ k 1)) (aref fields (+ k 2)) (aref fields (+ k 3)))))

(defmacro do-request-fields ((name-start name-end value-start value-end) request &body body)
  "Run BODY for each header field of REQUEST in order, with its bounds bound."
  (let ((r (gensym "REQUEST")) (fields (gensym "FIELDS")) (k (gensym "K")))
    `(let* ((,r ,request)
            (,fields (request-fields ,r)))
       (declare (type (or null field-index) ,fields))
       (when ,fields
         (loop for ,k of-type fixnum from 0 below (* 4 (request-field-count ,r)) by 4
               do (let ((,name-start (aref ,fields ,k))
                        (,name-end (aref ,fields (+ ,k 1)))
                        (,value-start (aref ,fields (+ ,k 2)))
                        (,value-end (aref ,fields (+ ,k 3))))
                    (declare (type fixnum ,name-start ,name-end ,value-start ,value-end)
                             (ignorable ,name-start ,name-end ,value-start ,value-end))
                    ,@body))))))
